"""Requests: what one rank asks the engine to do, and the signature ranks agree on.

A *request* is one named op submitted on one rank: the caller's buffer (a flat
view, see `collectives._buffers`), where the result goes, and the handle the
caller waits on.  Its *signature* is everything every rank must agree on for
that name: kind, dtype, shape, reduce op, root and scale factors.  For
allgather and alltoall the first dimension may differ per rank, so their
signature keeps only the trailing dimensions (the first is written -1).  Two
ranks that submit one name with two signatures are a *mismatch*.

Validation happens here, at the call, so programming mistakes raise
`ValueError` / `TypeError` in the caller's thread, never in the engine's.
"""
from __future__ import annotations

import math
import time
from typing import NamedTuple, Optional, Sequence

import numpy as np

from .. import _buffers as B
from ..adasum import check_world
from ..types import DType, ReduceOp, numpy_of_dtype
from .handle import Handle

__all__ = ["KINDS", "Signature", "Request", "make_request", "Memo"]

KINDS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "barrier")
_REDUCING = ("allreduce", "reducescatter")
_RAGGED = ("allgather", "alltoall")  # first dimension may differ per rank
_FLOATING = frozenset(d for d in DType if d.is_floating)


class Signature(NamedTuple):
    name: str
    kind: str
    dtype: int          # DType code
    shape: tuple        # -1 in front for ragged kinds
    op: int             # ReduceOp code (reducing kinds), else 0
    root: int           # broadcast root, else 0
    prescale: float
    postscale: float
    device: str = "cpu"
    strict_join: bool = False  # allgather/broadcast/Adasum refused once any rank has joined

    @classmethod
    def from_json(cls, item: list) -> "Signature":
        name, kind, dtype, shape, op, root, pre, post, device, strict = item
        return cls(name, kind, int(dtype), tuple(shape), int(op), int(root), float(pre),
                   float(post), device, bool(strict))

    @property
    def count(self) -> int:
        """Elements of the full tensor (not meaningful for ragged kinds)."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.count * DType(self.dtype).itemsize

    def tensor(self) -> str:
        """'name' dtype[dims], the way error messages name a tensor."""
        dims = ",".join("*" if d < 0 else str(d) for d in self.shape)
        return f"'{self.name}' {DType(self.dtype).name.lower()}[{dims}]"

    def brief(self) -> str:
        """What distinguishes this signature, without the name."""
        dims = ",".join("*" if d < 0 else str(d) for d in self.shape)
        text = f"{self.kind} {DType(self.dtype).name.lower()}[{dims}]"
        if self.kind in _REDUCING:
            text += f" op={ReduceOp(self.op).name.lower()}"
        if self.kind == "broadcast":
            text += f" root={self.root}"
        if self.prescale != 1.0 or self.postscale != 1.0:
            text += f" prescale={self.prescale:g} postscale={self.postscale:g}"
        if self.device != "cpu":
            text += f" on {self.device}"
        return text


class Request:
    """One submitted op on this rank; lives until its handle is finished."""

    __slots__ = ("sig", "buf", "out", "splits", "handle", "t_submit", "t_ready", "announced",
                 "ready")

    def __init__(self, sig: Signature, buf: Optional[B.Buf], out: Optional[B.Buf],
                 splits: Optional[list], handle: Handle) -> None:
        self.sig, self.buf, self.out, self.splits, self.handle = sig, buf, out, splits, handle
        self.t_submit = time.perf_counter()
        self.t_ready = 0.0
        self.announced = False
        self.ready = None  # CUDA: the event recorded on the producer's stream (`EngineStreams.ready`)

    @property
    def name(self) -> str:
        return self.sig.name


def _as_buf(buffer, dtype: Optional[DType], writable: bool, what: str) -> B.Buf:
    """The caller's tensor as a Buf; `dtype` overrides the logical dtype of a numpy buffer."""
    if dtype is None:
        return B.as_buf(buffer, writable=writable, what=what)
    dtype = DType(dtype)
    if not isinstance(buffer, np.ndarray) or buffer.dtype.itemsize != dtype.itemsize:
        raise TypeError(f"{what}: dtype={dtype.name.lower()} needs a numpy array with "
                        f"{dtype.itemsize}-byte items, got {type(buffer).__name__}"
                        f"{'' if not isinstance(buffer, np.ndarray) else ' of ' + str(buffer.dtype)}")
    if not buffer.flags.c_contiguous:
        raise ValueError(f"{what}: the array is not C-contiguous; pass np.ascontiguousarray(x)")
    flat = buffer.reshape(-1).view(numpy_of_dtype(dtype))
    return B.Buf(flat, dtype, buffer.shape, lambda a: a, "numpy", buffer)


def _check_op(kind: str, op, dtype: DType, prescale: float, postscale: float, what: str) -> ReduceOp:
    try:
        op = op if type(op) is ReduceOp else ReduceOp(op)
    except ValueError:
        raise ValueError(f"{what}: unknown reduce op {op!r}; use one of "
                         f"{', '.join(o.name for o in ReduceOp)}") from None
    if kind not in _REDUCING:
        if prescale != 1.0 or postscale != 1.0:
            raise ValueError(f"{what}: prescale/postscale apply to allreduce and reducescatter only")
        return ReduceOp.SUM
    if dtype not in _FLOATING and (op == ReduceOp.AVERAGE or prescale != 1.0 or postscale != 1.0):
        raise TypeError(f"{what}: AVERAGE and scale factors need a floating dtype, got "
                        f"{dtype.name.lower()}; use SUM and divide yourself")
    if op == ReduceOp.ADASUM:
        if kind != "allreduce":
            raise ValueError(f"{what}: Adasum is an allreduce op; {kind} takes SUM, AVERAGE, MIN, "
                             "MAX or PRODUCT")
        if dtype not in _FLOATING:
            raise TypeError(f"{what}: Adasum combines floating tensors (float16, bfloat16, "
                            f"float32, float64), got {dtype.name.lower()}")
    if dtype == DType.BOOL and op in (ReduceOp.SUM, ReduceOp.PRODUCT):
        raise TypeError(f"{what}: bool tensors reduce with MIN (and) or MAX (or) only")
    return op


def _check_splits(splits, dim0: int, size: int, what: str) -> Optional[list]:
    if splits is None:
        if dim0 % size:
            raise ValueError(f"{what}: first dimension {dim0} is not divisible by size {size}; "
                             "pass splits")
        return None
    splits = [int(s) for s in np.asarray(splits).reshape(-1)]
    if len(splits) != size or min(splits) < 0 or sum(splits) != dim0:
        raise ValueError(f"{what}: splits {splits} must be {size} non-negative numbers that "
                         f"sum to the first dimension {dim0}")
    return splits


def _out_buf(out, buf: B.Buf, kind: str, what: str) -> Optional[B.Buf]:
    if out is None:
        return None
    if out is buf.source:
        return buf
    if kind not in ("allreduce", "broadcast"):
        raise ValueError(f"{what}: out= is supported for allreduce and broadcast only")
    dst = B.as_buf(out, writable=True, what=f"{what} output")
    if dst.dtype != buf.dtype or dst.shape != buf.shape or dst.kind != buf.kind:
        raise ValueError(f"{what}: output {B.describe_tensor(None, dst)} ({dst.kind}) does not "
                         f"match input {B.describe_tensor(None, buf)} ({buf.kind})")
    return dst


def make_request(name: str, kind: str, buffer, out, op, prescale: float, postscale: float,
                 root: int, splits: Optional[Sequence[int]], dtype: Optional[DType],
                 rank: int, size: int, kick=None, strict_join: bool = False) -> Request:
    """Validate one submission and build its request (raises ValueError / TypeError)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"every op needs a non-empty name, got {name!r}")
    what = f"{kind} '{name}'"
    if kind not in KINDS:
        raise ValueError(f"{what}: unknown kind; use one of {', '.join(KINDS)}")
    if kind == "barrier":
        sig = Signature(name, kind, int(DType.UINT8), (), 0, 0, 1.0, 1.0)
        return Request(sig, None, None, None, Handle(name, kind, rank, size, sig, kick))
    writable = out is not None and out is buffer
    buf = _as_buf(buffer, dtype, writable, f"{what} input")
    rop = _check_op(kind, op, buf.dtype, float(prescale), float(postscale), what)
    if rop == ReduceOp.ADASUM:
        check_world(size, rank, what)
        if buf.kind == "cuda":
            raise ValueError(f"{what}: Adasum combines host tensors; copy the tensor to the CPU "
                             "first (horovod_spark.torch does)")
    if kind == "broadcast" and (not isinstance(root, (int, np.integer)) or not 0 <= root < size):
        raise ValueError(f"{what}: root must be a rank in [0, {size}), got {root!r}")
    shape = tuple(buf.shape)  # ints already (numpy shape, torch.Size)
    if kind in _RAGGED or kind == "reducescatter":
        shape = shape or (1,)
    if kind == "alltoall":
        splits = _check_splits(splits, shape[0], size, what)
    elif splits is not None:
        raise ValueError(f"{what}: splits apply to alltoall only")
    sig_shape = (-1,) + shape[1:] if kind in _RAGGED else shape
    device = "cuda" if buf.kind == "cuda" else "cpu"
    sig = Signature(name, kind, int(buf.dtype), sig_shape, int(rop),
                    int(root) if kind == "broadcast" else 0, float(prescale), float(postscale), device,
                    (bool(strict_join) and kind in ("allgather", "broadcast")) or rop == ReduceOp.ADASUM)
    handle = Handle(name, kind, rank, size, sig, kick)
    return Request(sig, buf, _out_buf(out, buf, kind, what), splits, handle)


class Memo:
    """The checked parts of a name's last request on a CPU torch tensor, reused when the
    same tensor comes back under that name with the same arguments (every step's
    gradients and metrics): its signature and flat views stay right as long as the
    tensor has the same storage address, shape and dtype and stays contiguous, which
    `fits` checks in a fraction of what `make_request`'s checks cost.  Only tensors the
    request views in place are memoized (not a contiguous copy of a strided input)."""

    __slots__ = ("args", "source", "out", "ptr", "shape", "dtype", "sig", "buf", "out_buf",
                 "splits")
    LIMIT = 4096  # names memoized per engine (unnamed ops count up: no unbounded growth)

    @classmethod
    def of(cls, req: Request, args: tuple, source, out) -> Optional["Memo"]:
        if req.buf is None or req.buf.kind != "torch" or req.buf.source is not source:
            return None
        m = cls()
        m.args, m.source, m.out, m.sig, m.buf, m.out_buf, m.splits = \
            args, source, out, req.sig, req.buf, req.out, req.splits
        m.ptr, m.shape, m.dtype = source.data_ptr(), source.shape, source.dtype
        return m

    def fits(self, args: tuple, source, out) -> bool:
        return (source is self.source and out is self.out and args == self.args
                and source.data_ptr() == self.ptr and source.shape == self.shape
                and source.dtype == self.dtype and source.is_contiguous())

    def request(self, rank: int, size: int, kick) -> Request:
        sig = self.sig
        return Request(sig, self.buf, self.out_buf, self.splits,
                       Handle(sig.name, sig.kind, rank, size, sig, kick))
