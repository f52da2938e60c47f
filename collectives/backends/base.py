"""The one interface every backend implements.

Terms: a *buffer* is a flat, C-contiguous numpy array (possibly a zero-copy
view of a torch tensor, or a CuPy array on the NCCL backend); its storage
dtype is numpy's, its logical dtype is the `DType` passed beside it (bfloat16
travels as uint16).  *Counts* are in elements.  The Communicator front end has
validated every argument before a backend sees it: buffers are contiguous,
lengths match counts, ops are legal for the dtype, AVERAGE is already turned
into SUM plus a postscale.  A backend only moves and reduces bytes.

Every op defaults to a clear `NotSupported` naming the backend and the op.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from ..errors import NotSupported
from ..types import DType, ReduceOp

__all__ = ["Backend", "Topology"]


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where every rank lives.  `hosts[r]` is the host identity of rank r."""

    rank: int
    size: int
    hosts: tuple
    addresses: tuple = ()  # "host:port" per rank where the backend has sockets
    #: per rank, the identity of its shared-memory group (ranks of one host that see one
    #: /dev/shm); empty: every host is one group.  Local ranks and sizes stay per host.
    shm_groups: tuple = ()

    def group_of(self, r: int):
        return self.shm_groups[r] if self.shm_groups else self.hosts[r]

    @property
    def shm_ranks(self) -> tuple:
        """World ranks in this rank's shared-memory group, in rank order."""
        me = self.group_of(self.rank)
        return tuple(r for r in range(self.size) if self.group_of(r) == me)

    @property
    def shm_order(self) -> tuple:
        """Distinct shared-memory groups in order of their lowest rank."""
        return tuple(dict.fromkeys(self.group_of(r) for r in range(self.size)))

    @property
    def local_ranks(self) -> tuple:
        """World ranks on this rank's host, in rank order."""
        me = self.hosts[self.rank]
        return tuple(r for r in range(self.size) if self.hosts[r] == me)

    @property
    def local_rank(self) -> int:
        return self.local_ranks.index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.local_ranks)

    @property
    def host_order(self) -> tuple:
        """Distinct hosts in order of their lowest rank."""
        seen: list = []
        for h in self.hosts:
            if h not in seen:
                seen.append(h)
        return tuple(seen)

    @property
    def cross_rank(self) -> int:
        return self.host_order.index(self.hosts[self.rank])

    @property
    def cross_size(self) -> int:
        return len(self.host_order)


class Backend:
    """Base class: every op refuses clearly until a subclass implements it."""

    name = "base"
    native_context = None  # the native backend's context, which a fusion lane runs over

    def __init__(self, topology: Topology) -> None:
        self.topology = topology

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def size(self) -> int:
        return self.topology.size

    def _refuse(self, op: str):
        raise NotSupported(f"backend {self.name} does not support {op}")

    # -- collectives -------------------------------------------------------
    def allreduce(self, src, dst, dtype: DType, op: ReduceOp) -> None:
        """dst[i] = reduce over ranks of src[i]; src may be dst (in place)."""
        self._refuse("allreduce")

    def allgather(self, src, dst, dtype: DType, counts: Sequence[int]) -> None:
        """dst = concat over ranks r of rank r's src (counts[r] elements)."""
        self._refuse("allgather")

    # The job's own coordination (the fusion engine's negotiation and cycle vector, shapes
    # before an allgather): a backend that tags frames tags these even where it leaves the
    # payload of other ops untagged (the native one: native/src/tcp/mac.h).
    def control_allreduce(self, src, dst, dtype: DType, op: ReduceOp) -> None:
        self.allreduce(src, dst, dtype, op)

    def control_allgather(self, src, dst, dtype: DType, counts: Sequence[int]) -> None:
        self.allgather(src, dst, dtype, counts)

    def broadcast(self, buf, dtype: DType, root: int) -> None:
        """buf on every rank = buf on root."""
        self._refuse("broadcast")

    def reducescatter(self, src, dst, dtype: DType, op: ReduceOp, counts: Sequence[int]) -> None:
        """dst on rank r = the reduced block r of src (blocks of counts[r] elements)."""
        self._refuse("reducescatter")

    def alltoall(self, src, send_counts: Sequence[int], dst, recv_counts: Sequence[int],
                 dtype: DType) -> None:
        """Block j of src (send_counts[j] elements) goes to rank j; block i of dst comes from rank i."""
        self._refuse("alltoall")

    def adasum(self, buf, dtype: DType, segments: Sequence[int]) -> None:
        """buf on every rank = the Adasum tree over ranks of buf (collectives.adasum), in
        place, each segment (a run of segments[i] elements) combined on its own.  This
        default gathers every rank's vector and runs the tree on each rank; the native
        backend exchanges halves instead (Context::adasum)."""
        from .. import adasum
        from ..types import numpy_of_dtype

        flat = np.asarray(buf).view(numpy_of_dtype(dtype)).reshape(-1)
        rows = np.empty((self.size, flat.size), flat.dtype)
        self.allgather(flat, rows.reshape(-1), dtype, [flat.size] * self.size)
        bounds = np.concatenate([[0], np.cumsum(segments)]).astype(int)
        flat[...] = adasum.tree(rows, list(zip(bounds[:-1], bounds[1:])))

    def barrier(self) -> None:
        self._refuse("barrier")

    def transport_metrics(self) -> dict:
        """Bytes and ops per transport (the native backend's); {} where not counted."""
        return {}

    def close(self) -> None:
        """Release sockets, shared memory and threads; safe to call twice."""
