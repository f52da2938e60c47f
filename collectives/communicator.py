"""The Communicator: the one front door to every backend.

It validates arguments (a `TypeError`/`ValueError` at the call, before any
communication), maps numpy and torch tensors to flat buffers without copying,
turns AVERAGE into SUM plus a postscale, numbers every op (its sequence
number appears in every error), and runs async ops in submission order on one
worker thread.  After a communication failure the communicator is broken:
every later op raises at once with the original cause, never hangs.
"""
from __future__ import annotations

import concurrent.futures
import math
import threading
from typing import Optional, Sequence

import numpy as np

from . import _buffers as B
from . import adasum
from .backends.base import Backend
from .settings import Config
from .errors import CollectiveError, MismatchError, describe
from .types import DType, ReduceOp

__all__ = ["Communicator", "Work"]

_META = 10  # dim0, ndim, dtype, then up to 7 trailing dims


class Work:
    """Handle of an async op: wait(timeout) returns its result or raises its error."""

    def __init__(self, future: concurrent.futures.Future) -> None:
        self._future = future

    def wait(self, timeout: Optional[float] = None):
        return self._future.result(timeout)

    def is_completed(self) -> bool:
        return self._future.done()

    def exception(self) -> Optional[BaseException]:
        return self._future.exception() if self._future.done() else None


class Communicator:
    def __init__(self, backend: Backend, config: Optional[Config] = None, *, store=None,
                 prefix: str = "", gpu_backend=None) -> None:
        self.backend = backend
        self.config = config or Config()
        self._store, self._prefix = store, prefix
        self._gpu = gpu_backend
        self._seq = 0
        self._broken: Optional[CollectiveError] = None
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._pending: list = []
        self._lock = threading.Lock()
        self._gpu_lock = threading.Lock()
        self._transport_base: dict = {}
        #: how this rank bootstrapped (host, bind address, secret): what a sub-communicator
        #: over the same store needs; None for a backend built otherwise (MPI)
        self._boot: Optional[tuple] = None

    @classmethod
    def create(cls, store, rank: int, size: int, host: str, bind_addr: str, secret: bytes,
               prefix: str, config: Optional[Config] = None,
               hosts: Sequence[str] = ()) -> "Communicator":
        """Bootstrap the native CPU backend over a mesh built through `store`; `hosts`:
        every rank's host, where the launcher gave them (RankEnv.hosts)."""
        from .rendezvous.mesh import build_mesh
        from .backends.native import NativeBackend

        config = config or Config()
        mesh = build_mesh(store, rank, size, host, bind_addr, secret, prefix,
                          config.connect_timeout, force_tcp=config.force_tcp,
                          integrity=config.mesh_integrity, hosts=hosts)
        comm = cls(NativeBackend(mesh, store, config, prefix), config, store=store, prefix=prefix)
        comm._boot = (host, bind_addr, secret)
        return comm

    def subset(self, ranks: Sequence[int], tag: str) -> "Communicator":
        """A communicator of its own among `ranks` (world ranks), its rank i being world rank
        ranks[i]; see `collectives.subgroup`.  Only the members call it, each with the same
        ranks and tag (a name no other subset of this communicator used)."""
        from .subgroup import sub_communicator

        return sub_communicator(self, ranks, tag)

    # -- placement ---------------------------------------------------------
    rank = property(lambda self: self.backend.topology.rank)
    size = property(lambda self: self.backend.topology.size)
    local_rank = property(lambda self: self.backend.topology.local_rank)
    local_size = property(lambda self: self.backend.topology.local_size)
    cross_rank = property(lambda self: self.backend.topology.cross_rank)
    cross_size = property(lambda self: self.backend.topology.cross_size)
    backend_name = property(lambda self: self.backend.name)

    # -- machinery ---------------------------------------------------------
    def _ctx(self, op: str, tensor="", seq: Optional[int] = None) -> dict:
        return dict(rank=self.rank, size=self.size, op=op, seq=self._seq if seq is None else seq,
                    tensor=_label(tensor) or None)

    def _run(self, op: str, tensor, fn, async_op: bool):
        """Number the op and run fn, now or on the worker thread.

        tensor is a label, or a (name, Buf) pair formatted only when an error
        needs it: the hot path of a small allreduce builds no strings.
        """
        with self._lock:
            if self._broken is not None:
                raise type(self._broken)(describe(f"communicator is broken by an earlier failure: "
                                                  f"{self._broken}", **self._ctx(op, tensor)))
            self._seq += 1
            seq = self._seq
        if async_op:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="collectives")
            fut = self._pool.submit(self._guarded, fn, op, seq, tensor)
            self._pending = [f for f in self._pending if not f.done()] + [fut]
            return Work(fut)
        if self._pending:
            for fut in self._pending:  # keep submission order
                fut.exception()
            self._pending = []
        return self._guarded(fn, op, seq, tensor)

    def _guarded(self, fn, op: str, seq: int, tensor):
        try:
            return fn()
        except CollectiveError as exc:
            err = exc if f"#{seq}" in str(exc) else type(exc)(describe(str(exc), **self._ctx(op, tensor, seq)))
            self._broken = err
            raise err from exc

    def _backend_for(self, buf: B.Buf):
        if buf.kind != "cuda":
            return self.backend
        if self._gpu is None:
            with self._gpu_lock:  # two threads' first CUDA ops must not both bootstrap NCCL
                if self._gpu is None:
                    from .backends.nccl import NcclBackend

                    self._gpu = NcclBackend.create(self._store, self.backend.topology,
                                                   self._prefix, self.config,
                                                   device=_device_of(buf.source))
        return self._gpu

    @staticmethod
    def _check_scaling(op: ReduceOp, dtype: DType, prescale: float, postscale: float, what: str):
        if dtype.is_floating:
            return
        if op == ReduceOp.AVERAGE:
            raise TypeError(f"{what}: AVERAGE needs a floating dtype, got {dtype.name.lower()}; "
                            "use SUM and divide yourself")
        if prescale != 1.0 or postscale != 1.0:
            raise TypeError(f"{what}: prescale/postscale need a floating dtype, got {dtype.name.lower()}")

    # -- ops ---------------------------------------------------------------
    def _stream(self, backend, buf: B.Buf) -> dict:
        """CUDA ops capture the caller's current stream on the caller's thread."""
        return {"stream": backend.stream_of(buf.source)} if buf.kind == "cuda" else {}

    def allreduce(self, x, out=None, op: ReduceOp = ReduceOp.SUM, prescale: float = 1.0,
                  postscale: float = 1.0, async_op: bool = False, name: Optional[str] = None):
        """Reduce x over ranks; out=x reduces in place.  Returns the result."""
        if type(op) is not ReduceOp:
            op = ReduceOp(op)
        src = B.as_buf(x, what="allreduce input")
        self._check_scaling(op, src.dtype, prescale, postscale, "allreduce")
        if op == ReduceOp.AVERAGE:
            op, postscale = ReduceOp.SUM, postscale / self.size
        backend = self._backend_for(src)
        dst = src if out is x else self._out_buf(out, src, "allreduce")
        kw = self._stream(backend, src)

        if op == ReduceOp.ADASUM:
            adasum.check_world(self.size, self.rank, "allreduce")
            if src.kind == "cuda" or src.dtype not in adasum.NATIVE_DTYPES:
                raise TypeError(f"allreduce: Adasum on a Communicator combines float16, float32 "
                                f"or float64 host arrays, got {src.dtype.name.lower()} "
                                f"({src.kind}); bfloat16 and device tensors go through the "
                                "fusion engine (horovod_spark.torch does)")

        def run():
            if op == ReduceOp.ADASUM:
                if dst.flat is not src.flat:
                    np.copyto(dst.flat, src.flat)
                B.scale_(dst.flat, src.dtype, prescale)
                backend.adasum(dst.flat, src.dtype, [dst.flat.size])
            elif src.kind == "cuda":
                backend.allreduce_tensor(src.flat, dst.flat, src.dtype, op, prescale, postscale, **kw)
            elif prescale != 1.0:
                if dst.flat is not src.flat:
                    np.copyto(dst.flat, src.flat)
                B.scale_(dst.flat, src.dtype, prescale)
                backend.allreduce(dst.flat, dst.flat, src.dtype, op)
            else:
                backend.allreduce(src.flat, dst.flat, src.dtype, op)
            if src.kind != "cuda":
                B.scale_(dst.flat, src.dtype, postscale)
            return dst.source if dst.source is not None else dst.wrap(dst.flat.reshape(src.shape))

        return self._run("allreduce", (name, src), run, async_op)

    def allreduce_flat(self, src: np.ndarray, dst: np.ndarray, dtype: DType, op: ReduceOp,
                       postscale: float = 1.0, name: Optional[str] = None,
                       control: bool = False) -> None:
        """The fusion engine's allreduce: flat, C-contiguous CPU arrays of `dtype` that it
        checked when they were submitted, and an op the backend reduces (not AVERAGE).
        `control`: the engine's own coordination (`Backend.control_allreduce`).

        Numbered and guarded like every op; it only skips the checks and conversions of
        `allreduce`, which cost more than the collective itself for a small buffer."""
        backend = self.backend
        reduce = backend.control_allreduce if control else backend.allreduce

        def run():
            reduce(src, dst, dtype, op)
            if postscale != 1.0:
                B.scale_(dst, dtype, postscale)

        self._run("allreduce", (name, B.Buf(src, dtype, src.shape, None, "numpy")), run, False)

    def adasum_flat(self, buf: np.ndarray, dtype: DType, segments: Sequence[int],
                    name: Optional[str] = None) -> None:
        """The fusion engine's Adasum (collectives.adasum), in place on a flat CPU array of a
        floating `dtype` (not bfloat16): `segments` are the element counts of the tensors
        packed in it, each combined with its own dot products.  Numbered and guarded like
        every op."""
        backend = self.backend

        def run():
            backend.adasum(buf, dtype, segments)

        self._run("allreduce", (name, B.Buf(buf, dtype, buf.shape, None, "numpy")), run, False)

    def flat(self, op: str, *args, then=None):
        """The backend's `op` (allreduce, allgather, broadcast, reducescatter, alltoall,
        barrier: `Backend`'s signatures) on flat CPU buffers the caller checked, numbered and
        guarded like every op, then `then()`; returns then()'s value.  For adapters that
        convert their own tensors and run ops on threads of their own (torch's c10d
        backend)."""
        fn = getattr(self.backend, op)

        def run():
            fn(*args)
            return then() if then is not None else None

        return self._run(op, "", run, False)

    def _out_buf(self, out, src: B.Buf, what: str) -> B.Buf:
        if out is None:
            return B.Buf(B.empty_for(src, _numel(src.shape)), src.dtype, src.shape, src.wrap,
                         src.kind, None)
        dst = B.as_buf(out, writable=True, what=f"{what} output")
        if dst.dtype != src.dtype or _numel(dst.shape) != _numel(src.shape) or dst.kind != src.kind:
            raise ValueError(f"{what}: output {B.describe_tensor(None, dst)} ({dst.kind}) does not "
                             f"match input {B.describe_tensor(None, src)} ({src.kind})")
        return dst

    def _gather_meta(self, src: B.Buf, what: str) -> np.ndarray:
        shape = src.shape if src.shape else (1,)
        if len(shape) > _META - 2:
            raise ValueError(f"{what}: at most {_META - 3} trailing dimensions, got shape {shape}")
        meta = np.zeros(_META, np.int64)
        meta[:3] = (shape[0], len(shape), int(src.dtype))
        meta[3:3 + len(shape) - 1] = shape[1:]
        allmeta = np.empty(_META * self.size, np.int64)
        self.backend.control_allgather(meta, allmeta, DType.INT64, [_META] * self.size)
        allmeta = allmeta.reshape(self.size, _META)
        if not (allmeta[:, 1:] == allmeta[0, 1:]).all():
            shapes = "; ".join(f"rank {r}: {DType(int(m[2])).name.lower()}"
                               f"[{','.join(['*'] + [str(d) for d in m[3:2 + int(m[1])]])}]"
                               for r, m in enumerate(allmeta))
            raise MismatchError(describe(f"ranks disagree on dtype or trailing shape ({shapes})",
                                         **self._ctx(what)))
        return allmeta

    def allgather(self, x, async_op: bool = False, name: Optional[str] = None,
                  control: bool = False):
        """Concatenate every rank's x along dim 0 (first dims may differ).  `control`: the
        job's own coordination (`Backend.control_allgather`)."""
        src = B.as_buf(x, what="allgather input")
        shape = src.shape if src.shape else (1,)
        row = _numel(shape[1:])
        backend = self._backend_for(src)
        kw = self._stream(backend, src)
        gather = backend.control_allgather if control and not kw else backend.allgather

        def run():
            rows = [int(m[0]) for m in self._gather_meta(src, "allgather")]
            dst = B.empty_for(src, sum(rows) * row)
            gather(src.flat, dst, src.dtype, [r * row for r in rows], **kw)
            return src.wrap(dst.reshape((sum(rows),) + tuple(shape[1:])))

        return self._run("allgather", (name, src), run, async_op)

    def broadcast(self, x, root: int = 0, async_op: bool = False, name: Optional[str] = None):
        """Overwrite x on every rank with root's x; returns x."""
        self._check_root(root, "broadcast")
        buf = B.as_buf(x, writable=True, what="broadcast buffer")
        backend = self._backend_for(buf)
        kw = self._stream(backend, buf)

        def run():
            backend.broadcast(buf.flat, buf.dtype, root, **kw)
            return x

        return self._run("broadcast", (name, buf), run, async_op)

    def _check_root(self, root: int, what: str) -> None:
        if not isinstance(root, (int, np.integer)) or not 0 <= root < self.size:
            raise ValueError(f"{what}: root must be a rank in [0, {self.size}), got {root!r}")

    def _rows_split(self, rows: int, counts: Optional[Sequence[int]], what: str) -> list:
        if counts is None:
            base, rem = divmod(rows, self.size)
            return [base + (1 if r < rem else 0) for r in range(self.size)]
        counts = [int(c) for c in counts]
        if len(counts) != self.size or sum(counts) != rows or min(counts) < 0:
            raise ValueError(f"{what}: splits {counts} must be {self.size} non-negative numbers "
                             f"that sum to the first dimension {rows}")
        return counts

    def reducescatter(self, x, op: ReduceOp = ReduceOp.SUM, counts: Optional[Sequence[int]] = None,
                      async_op: bool = False, name: Optional[str] = None):
        """Reduce x over ranks, then keep this rank's block of rows (`counts` rows per rank)."""
        op = ReduceOp(op)
        src = B.as_buf(x, what="reducescatter input")
        self._check_scaling(op, src.dtype, 1.0, 1.0, "reducescatter")
        shape = src.shape if src.shape else (1,)
        row = _numel(shape[1:])
        rows = self._rows_split(shape[0], counts, "reducescatter")
        post = 1.0 / self.size if op == ReduceOp.AVERAGE else 1.0
        rop = ReduceOp.SUM if op == ReduceOp.AVERAGE else op
        backend = self._backend_for(src)
        kw = self._stream(backend, src)

        def run():
            dst = B.empty_for(src, rows[self.rank] * row)
            backend.reducescatter(src.flat, dst, src.dtype, rop, [r * row for r in rows], **kw)
            B.scale_(dst, src.dtype, post)
            return src.wrap(dst.reshape((rows[self.rank],) + tuple(shape[1:])))

        return self._run("reducescatter", (name, src), run, async_op)

    def alltoall(self, x, splits: Optional[Sequence[int]] = None, async_op: bool = False,
                 name: Optional[str] = None):
        """Send rows splits[j] to rank j; returns (received rows, received splits)."""
        src = B.as_buf(x, what="alltoall input")
        shape = src.shape if src.shape else (1,)
        row = _numel(shape[1:])
        if splits is None and shape[0] % self.size:
            raise ValueError(f"alltoall: first dimension {shape[0]} is not divisible by size "
                             f"{self.size}; pass splits")
        send = self._rows_split(shape[0], splits, "alltoall")
        backend = self._backend_for(src)
        kw = self._stream(backend, src)

        def run():
            recv = np.empty(self.size, np.int64)
            ones = [1] * self.size
            self.backend.alltoall(np.asarray(send, np.int64), ones, recv, ones, DType.INT64)
            total = int(recv.sum())
            dst = B.empty_for(src, total * row)
            backend.alltoall(src.flat, [s * row for s in send], dst, [int(r) * row for r in recv],
                             src.dtype, **kw)
            return src.wrap(dst.reshape((total,) + tuple(shape[1:]))), recv

        return self._run("alltoall", (name, src), run, async_op)

    def barrier(self) -> None:
        self._run("barrier", "", self.backend.barrier, False)

    def transport_metrics(self, reset: bool = False) -> dict:
        """Bytes and ops per transport (shm_*, tcp_*) since bootstrap or the last reset."""
        now = self.backend.transport_metrics()
        out = {k: v - self._transport_base.get(k, 0) for k, v in now.items()}
        if reset:
            self._transport_base = now
        return out

    def close(self) -> None:
        """Finish pending async ops, then release the backends.  Safe to call twice."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for b in (self._gpu, self.backend):
            if b is not None:
                b.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _label(tensor) -> str:
    if isinstance(tensor, tuple):
        return B.describe_tensor(*tensor)
    return tensor or ""


def _device_of(x) -> Optional[int]:
    dev = getattr(x, "device", None)
    index = getattr(dev, "index", None)  # torch.device
    if index is not None:
        return int(index)
    return getattr(dev, "id", None)      # cupy.cuda.Device


def _numel(shape) -> int:
    return math.prod(int(d) for d in shape)
