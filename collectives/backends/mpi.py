"""The MPI backend: every collective on mpi4py, for ranks started by mpiexec.

Terms: the *world* is the communicator the backend was built from (a private
duplicate of `MPI.COMM_WORLD` unless another is given), so our traffic never
matches a user's own MPI calls; a *host* is one shared-memory domain, found by
splitting the world with `MPI.COMM_TYPE_SHARED`; its identity is the
processor name (suffixed with the host's lowest world rank where two domains
report the same name).  Rank, size and placement come from MPI, never from
the environment.

Each op maps onto one MPI call (Allreduce, Allgatherv, Bcast,
Reduce_scatter, Alltoallv, Barrier) with explicit `[buffer, count(s),
datatype]` specs, so numpy's type codes never choose the datatype; see
`_mpi_types` for the datatypes and the float16 / bfloat16 / bool reductions.
The world's error handler is `ERRORS_RETURN`; every MPI error becomes one of
our exceptions naming the rank, the op and its sequence number, in `_translate`.
Calls are serialized by a lock (the fusion engine's thread and the caller's
may both reach the backend); their order across ranks is the front end's job.

mpi4py is imported lazily: `import collectives` works without it, and
`available()` says what is missing.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Mapping, Optional, Sequence, Tuple

import numpy as np

from .._gpu import import_or_refuse
from ..errors import CollectiveError, NotSupported, PeerLostError, describe
from ..types import DType, ReduceOp
from .base import Backend, Topology

__all__ = ["MpiBackend", "available", "launched_by_mpiexec", "INSTALL_HINT"]

INSTALL_HINT = "pip install mpi4py mpich (the mpich wheel provides the MPI runtime)"

#: Variables that MPI launchers set in every rank process: MPICH / Intel MPI
#: (Hydra: PMI_RANK, MPI_LOCALRANKID), PMIx (Open MPI 5, PRRTE), Open MPI,
#: MVAPICH, Cray PALS.  Slurm's own SLURM_PROCID alone is not an MPI launch.
MPIEXEC_VARIABLES = (
    "PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
    "MPI_LOCALRANKID", "MV2_COMM_WORLD_RANK", "PALS_RANKID", "PMI_ID",
)

_HOST_NAME_BYTES = 256


def launched_by_mpiexec(environ: Mapping[str, str]) -> bool:
    """Whether this process looks like a rank started by mpiexec / mpirun."""
    return any(environ.get(var, "") != "" for var in MPIEXEC_VARIABLES)


def available() -> Tuple[bool, str]:
    """(True, library version) or (False, what is missing and how to install it).

    It imports mpi4py.MPI, which initializes MPI in this process (a singleton
    world of one outside mpiexec); `launched_by_mpiexec` is the side-effect-free test.
    """
    try:
        MPI = _import_mpi()
    except NotSupported as exc:
        return False, str(exc)
    return True, MPI.Get_library_version().splitlines()[0].strip()


def _import_mpi():
    import_or_refuse("mpi", "mpi4py", "mpi4py is not installed", INSTALL_HINT)
    return import_or_refuse("mpi", "mpi4py.MPI", "mpi4py cannot load an MPI runtime",
                            INSTALL_HINT + ", or point MPI4PY_LIBMPI at libmpi",
                            (ImportError, RuntimeError, OSError))


def _same_memory(MPI, a, b) -> bool:
    """a and b are the same memory (in place), not merely overlapping."""
    return a.nbytes == b.nbytes and MPI.buffer(a).address == MPI.buffer(b).address


def _tensor(dtype: Optional[DType], count: int) -> Optional[str]:
    return None if dtype is None else f"{DType(dtype).name.lower()}[{count}]"


def _displacements(counts: Sequence[int]) -> list:
    displs, at = [], 0
    for c in counts:
        displs.append(at)
        at += int(c)
    return displs


class MpiBackend(Backend):
    """Collectives over an MPI communicator; see the module docstring."""

    name = "mpi"

    def __init__(self, topology: Topology, comm, MPI, config=None) -> None:
        super().__init__(topology)
        self.config = config
        self._comm = comm
        self._MPI = MPI
        self._lock = threading.Lock()
        self._seq = 0
        from ._mpi_types import Kernels, storage_type
        self._kernels = Kernels(MPI)
        self._types = {d: storage_type(MPI, d) for d in DType}

    # -- construction ------------------------------------------------------
    @classmethod
    def from_world(cls, config=None, comm=None) -> "MpiBackend":
        """Build the backend over a duplicate of `comm` (default MPI.COMM_WORLD).

        Raises:
            NotSupported: mpi4py or an MPI runtime is missing, or MPI was
                initialized without thread support the backend needs.
        """
        MPI = _import_mpi()
        provided = MPI.Query_thread()
        if provided < MPI.THREAD_SERIALIZED:
            raise NotSupported(describe(
                f"backend mpi needs MPI_THREAD_SERIALIZED or better, MPI was initialized with level {provided}",
                rank=MPI.COMM_WORLD.Get_rank(), size=MPI.COMM_WORLD.Get_size(),
                hint="leave mpi4py.rc.thread_level at 'multiple' (the default) before importing mpi4py.MPI"))
        world = (MPI.COMM_WORLD if comm is None else comm).Dup()
        world.Set_errhandler(MPI.ERRORS_RETURN)
        topology = Topology(rank=world.Get_rank(), size=world.Get_size(),
                            hosts=_host_identities(MPI, world))
        return cls(topology, world, MPI, config)

    @property
    def comm(self):
        """The private MPI communicator (for tests and benchmarks)."""
        return self._comm

    # -- collectives -------------------------------------------------------
    def allreduce(self, src, dst, dtype: DType, op: ReduceOp) -> None:
        MPI, dt, count = self._MPI, self._types[dtype], dst.size
        mpi_op = self._kernels.op(dtype, op)
        if count == 0 or (np.may_share_memory(src, dst) and _same_memory(MPI, src, dst)):
            self._invoke("allreduce", dtype, count, self._comm.Allreduce,
                         MPI.IN_PLACE, [dst, count, dt], mpi_op)
            return
        if np.may_share_memory(src, dst):  # partial overlap: MPI forbids aliasing
            src = src.copy()
        self._invoke("allreduce", dtype, count, self._comm.Allreduce,
                     [src, count, dt], [dst, count, dt], mpi_op)

    def allgather(self, src, dst, dtype: DType, counts: Sequence[int]) -> None:
        dt, counts = self._types[dtype], [int(c) for c in counts]
        self._invoke("allgather", dtype, sum(counts), self._comm.Allgatherv,
                     [src, counts[self.rank], dt], [dst, (counts, _displacements(counts)), dt])

    def broadcast(self, buf, dtype: DType, root: int) -> None:
        self._invoke("broadcast", dtype, buf.size, self._comm.Bcast,
                     [buf, buf.size, self._types[dtype]], int(root), peer=root)

    def reducescatter(self, src, dst, dtype: DType, op: ReduceOp, counts: Sequence[int]) -> None:
        dt, counts = self._types[dtype], [int(c) for c in counts]
        mpi_op = self._kernels.op(dtype, op)
        self._invoke("reducescatter", dtype, sum(counts), self._comm.Reduce_scatter,
                     [src, sum(counts), dt], [dst, counts[self.rank], dt], counts, mpi_op)

    def alltoall(self, src, send_counts: Sequence[int], dst, recv_counts: Sequence[int],
                 dtype: DType) -> None:
        dt = self._types[dtype]
        send_counts = [int(c) for c in send_counts]
        recv_counts = [int(c) for c in recv_counts]
        self._invoke("alltoall", dtype, sum(send_counts), self._comm.Alltoallv,
                     [src, (send_counts, _displacements(send_counts)), dt],
                     [dst, (recv_counts, _displacements(recv_counts)), dt])

    def barrier(self) -> None:
        self._invoke("barrier", None, 0, self._comm.Barrier)

    def close(self) -> None:
        with self._lock:
            comm, self._comm = self._comm, None
            self._kernels.free()
            if comm is not None and not self._MPI.Is_finalized():
                with contextlib.suppress(Exception):
                    comm.Free()

    # -- helpers -----------------------------------------------------------
    def _invoke(self, op: str, dtype: Optional[DType], count: int, call, *args, peer=None) -> None:
        """Run one MPI call under the lock; turn its failures into our exceptions."""
        with self._lock:
            self._seq += 1
            if self._comm is None:
                raise CollectiveError(describe("the MPI backend is closed", rank=self.rank,
                                               size=self.size, op=op, seq=self._seq,
                                               tensor=_tensor(dtype, count)))
            try:
                call(*args)
            except self._MPI.Exception as exc:
                raise self._translate(exc, op, self._seq, _tensor(dtype, count), peer) from exc
            if self._kernels.failure is not None:
                failure = self._kernels.take_failure()
                raise CollectiveError(describe(
                    f"the {DType(dtype).name.lower()} reduction kernel failed: {failure!r}",
                    rank=self.rank, size=self.size, op=op, seq=self._seq,
                    tensor=_tensor(dtype, count), hint="the result on this rank is not valid")) from failure

    def _translate(self, exc, op: str, seq: int, tensor, peer) -> CollectiveError:
        """The one place an MPI error code becomes a Python exception."""
        MPI = self._MPI
        cls_code = exc.Get_error_class()
        text = " | ".join(line.strip() for line in exc.Get_error_string().splitlines() if line.strip())
        lost = {getattr(MPI, n) for n in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
                if hasattr(MPI, n)}
        if cls_code in lost:
            kind, hint = PeerLostError, "a rank died; mpiexec's output names it"
        elif cls_code == getattr(MPI, "ERR_ROOT", None) and peer is not None:
            kind, hint = CollectiveError, f"root must be in 0..{self.size - 1}"
        else:
            kind, hint = CollectiveError, None
        return kind(describe(f"MPI error class {cls_code}: {text}", rank=self.rank, size=self.size,
                             op=op, seq=seq, tensor=tensor, peer=peer, hint=hint))


def _host_identities(MPI, world) -> tuple:
    """hosts[r] for every rank r, from a COMM_TYPE_SHARED split and processor names.

    Exchanged as fixed-size byte records (never pickles).
    """
    shared = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    try:
        leader = np.array([world.Get_rank()], dtype=np.int64)
        shared.Allreduce(MPI.IN_PLACE, [leader, 1, MPI.INT64_T], MPI.MIN)
    finally:
        shared.Free()
    size = world.Get_size()
    name = MPI.Get_processor_name().encode("utf-8")[:_HOST_NAME_BYTES]
    record = np.zeros(_HOST_NAME_BYTES + 8, dtype=np.uint8)
    record[:len(name)] = np.frombuffer(name, dtype=np.uint8)
    record[_HOST_NAME_BYTES:] = leader.view(np.uint8)
    table = np.empty((size, record.size), dtype=np.uint8)
    world.Allgather([record, record.size, MPI.BYTE], [table, record.size, MPI.BYTE])
    names = [bytes(row[:_HOST_NAME_BYTES]).rstrip(b"\0").decode("utf-8", "replace") for row in table]
    leaders = [int(row[_HOST_NAME_BYTES:].view(np.int64)[0]) for row in table]
    hosts = []
    for r in range(size):
        clash = any(names[q] == names[r] and leaders[q] != leaders[r] for q in range(size))
        hosts.append(f"{names[r]}/{leaders[r]}" if clash else names[r])
    return tuple(hosts)
