"""NCCL bootstrap: one exchange of per-rank records through the rendezvous Store.

Terms: a *record* is what one rank publishes, as JSON bytes (never a pickle):
its host identity, its GPU identity (PCI bus id) and, from rank 0 only, the
NCCL *unique id* (hex of 128 bytes) every rank passes to ncclCommInitRank.
The exchange follows the bootstrap contract of docs/architecture.md: every
rank sets exactly one key, `{prefix}/nccl/rank/{rank}`, then reads every
rank's, so under Spark each record travels in one allGather round.

Without a store (the MPI backend has none), the records travel by
`MPI_Allgather` on `MPI.COMM_WORLD`, whose ranks the MPI backend uses.

After the exchange, ranks that share a GPU on one host are refused, on every
rank, with the same message, before any rank enters NCCL (which would hang or
fail obscurely).
"""
from __future__ import annotations

import json
from typing import Callable, List, Optional

from .._gpu import check_exclusive_gpus
from ..errors import CollectiveError, CollectiveTimeout, describe
from ._nccl_types import UNIQUE_ID_BYTES
from .base import Topology

__all__ = ["bootstrap", "exchange_records"]


def exchange_records(store, topology: Topology, prefix: str, record: dict,
                     timeout: float) -> List[dict]:
    """Publish this rank's record and return every rank's, in rank order."""
    blob = json.dumps(record, sort_keys=True).encode()
    if store is None:
        return [json.loads(b) for b in _mpi_allgather(blob, topology)]
    rank, size = topology.rank, topology.size
    store.set(f"{prefix}/nccl/rank/{rank}", blob)
    out = []
    for r in range(size):
        try:
            out.append(json.loads(store.get(f"{prefix}/nccl/rank/{r}", timeout)))
        except CollectiveTimeout:
            raise CollectiveTimeout(describe("no NCCL bootstrap record", rank=rank, size=size,
                                             op="nccl init", peer=r, timeout=timeout,
                                             hint="did that rank reach its first CUDA collective?")) from None
        except ValueError as exc:
            raise CollectiveError(describe(f"malformed NCCL bootstrap record ({exc})", rank=rank,
                                           size=size, op="nccl init", peer=r)) from None
    return out


def _mpi_allgather(blob: bytes, topology: Topology) -> List[bytes]:
    import sys

    MPI = getattr(sys.modules.get("mpi4py"), "MPI", None)
    if MPI is None or not MPI.Is_initialized():
        raise ValueError("NcclBackend.create: no store to exchange the NCCL unique id through, "
                         "and MPI is not running; pass the communicator's store")
    world = MPI.COMM_WORLD
    if (world.Get_rank(), world.Get_size()) != (topology.rank, topology.size):
        raise ValueError(f"NcclBackend.create: without a store the ranks must be MPI.COMM_WORLD's, "
                         f"got rank {topology.rank}/{topology.size} vs "
                         f"{world.Get_rank()}/{world.Get_size()}")
    import numpy as np

    # Lengths, then bytes: raw buffers, no pickles.
    lengths = np.zeros(topology.size, dtype=np.int64)
    world.Allgather([np.array([len(blob)], dtype=np.int64), 1, MPI.INT64_T], [lengths, 1, MPI.INT64_T])
    data = np.empty(int(lengths.sum()), dtype=np.uint8)
    displs = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    world.Allgatherv([np.frombuffer(blob, dtype=np.uint8), len(blob), MPI.BYTE],
                     [data, (lengths.tolist(), displs.tolist()), MPI.BYTE])
    return [data[d:d + n].tobytes() for d, n in zip(displs.tolist(), lengths.tolist())]


def bootstrap(store, topology: Topology, prefix: str, gpu_identity: str,
              make_unique_id: Callable[[], bytes], timeout: float) -> bytes:
    """Exchange records, refuse shared GPUs, return rank 0's unique id.

    Raises:
        CollectiveError: two ranks share a GPU, or a record is malformed.
        CollectiveTimeout: a rank's record did not arrive within `timeout`.
    """
    rank, size = topology.rank, topology.size
    uid: Optional[bytes] = make_unique_id() if rank == 0 else None
    record = {"host": topology.hosts[rank], "gpu": gpu_identity, "uid": uid.hex() if uid else ""}
    records = exchange_records(store, topology, prefix, record, timeout)
    check_exclusive_gpus([(r, rec.get("host"), rec.get("gpu")) for r, rec in enumerate(records)], size)
    try:
        uid = bytes.fromhex(records[0]["uid"])
    except (KeyError, ValueError):
        uid = b""
    if len(uid) != UNIQUE_ID_BYTES:
        raise CollectiveError(describe(f"rank 0's NCCL unique id has {len(uid)} bytes, not "
                                       f"{UNIQUE_ID_BYTES}", rank=rank, size=size, op="nccl init",
                                       peer=0))
    return uid
