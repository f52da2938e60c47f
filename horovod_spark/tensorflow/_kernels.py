"""The numpy kernels behind every TensorFlow op: arrays in, arrays out.

Every kernel goes through the fusion engine that init() started, so TensorFlow
ops are negotiated, fused, timed and checked exactly like torch's.  A *group*
is a list of arrays submitted together, each under its own name, and waited
for together; the engine fuses them into one collective per dtype (up to the
fusion threshold), so a model's gradients cost one engine cycle per step.

Integers reduce as Horovod's do: AVERAGE is a sum divided with truncation
toward zero, and scale factors multiply in float64, truncated back to the
dtype; the engine reduces floats only with either, so it sees a plain sum.
Ops that only move bytes (allgather, broadcast, alltoall) carry unsigned
integers the engine has no code for as the signed type of their width.
Every kernel waits for its ops at once, so it submits them `lazy`: the wait
runs the engine's cycle on this thread (TensorFlow's), with no hand-over to
the engine's thread.
"""
from __future__ import annotations

from typing import Optional, Sequence

import cloudpickle
import numpy as np

from collectives import ReduceOp, adasum

from . import _basics

__all__ = ["allreduce_group", "adasum_group", "broadcast_group", "allgather", "alltoall", "reducescatter",
           "allgather_group", "reducescatter_group",
           "barrier", "join", "broadcast_object", "allgather_object"]


_BYTES_AS = {np.dtype(np.uint16): np.dtype(np.int16), np.dtype(np.uint32): np.dtype(np.int32),
             np.dtype(np.uint64): np.dtype(np.int64)}


def _moved(a: np.ndarray) -> np.ndarray:
    """`a` as the engine can move it (the same bytes)."""
    a = np.ascontiguousarray(a)
    alias = _BYTES_AS.get(a.dtype)
    return a if alias is None else a.view(alias)


def _scale_int(a: np.ndarray, factor: float) -> np.ndarray:
    return np.trunc(a.astype(np.float64) * factor).astype(a.dtype)


class _IntPlan:
    """An integer reduction with AVERAGE or scale factors: a scaled input, the op the
    engine runs, and finish() for the result."""

    def __init__(self, a: np.ndarray, op: ReduceOp, pre: float, post: float) -> None:
        self.input = _scale_int(a, pre) if pre != 1.0 else a
        self.average = op == ReduceOp.AVERAGE
        self.op = ReduceOp.SUM if self.average else op
        self.post = post

    def finish(self, r: np.ndarray, n: int) -> np.ndarray:
        if self.post != 1.0:  # one scaling: Horovod folds 1/size into the postscale
            return _scale_int(r, self.post / (n if self.average else 1))
        if self.average:  # toward zero, exactly (no float64 round trip)
            q = np.abs(r) // r.dtype.type(n)
            return np.where(r < 0, -q, q).astype(r.dtype)
        return r


def _plan(a: np.ndarray, op: ReduceOp, pre: float, post: float) -> "Optional[_IntPlan]":
    if not np.issubdtype(a.dtype, np.integer):
        return None
    if op != ReduceOp.AVERAGE and pre == 1.0 and post == 1.0:
        return None
    return _IntPlan(a, op, pre, post)


def _submit_reduce(eng, kind: str, name: str, a: np.ndarray, op: ReduceOp, pre: float,
                   post: float):
    plan = _plan(a, op, pre, post)
    if plan is None:
        return eng.submit(name, kind, a, op=op, prescale=pre, postscale=post, lazy=True), None
    return eng.submit(name, kind, plan.input, op=plan.op, lazy=True), plan


def allreduce_group(arrays: Sequence[np.ndarray], names: Sequence[str], op: ReduceOp,
                    prescale: float = 1.0, postscale: float = 1.0, ps=None) -> list:
    """Reduce every array over ranks (of the process set `ps`, a view; None: every rank);
    returns new arrays in the same order.  Every kernel here takes `ps` alike."""
    eng = _basics.engine_of(ps)
    op = ReduceOp(op)
    pending = []
    for a, name in zip(arrays, names):
        flat = np.ascontiguousarray(a)  # 0-d arrays come back 1-d: keep the shape apart
        handle, plan = _submit_reduce(eng, "allreduce", name, flat, op, prescale, postscale)
        pending.append((handle, np.shape(a), plan))
    out = []
    for handle, shape, plan in pending:
        r = np.asarray(handle.wait()).reshape(shape)
        out.append(r if plan is None else plan.finish(r, _basics.size_of(ps)))
    return out


def adasum_group(arrays: Sequence[np.ndarray], names: Sequence[str], prescale: float = 1.0,
                 postscale: float = 1.0, ps=None) -> list:
    """Adasum of every array over ranks, each on its own (see collectives.adasum): an
    allreduce of op ADASUM per array, which the engine fuses and the backend combines."""
    eng = _basics.engine_of(ps)
    handles = [eng.submit(name, "allreduce", np.ascontiguousarray(a).reshape(-1),
                          op=ReduceOp.ADASUM, prescale=prescale, postscale=postscale, lazy=True)
               for a, name in zip(arrays, names)]
    return [np.asarray(h.wait()).reshape(np.shape(a)) for h, a in zip(handles, arrays)]


def broadcast_group(arrays: Sequence[np.ndarray], names: Sequence[str], root: int,
                    ps=None) -> list:
    """Every array as root (a set rank) has it; returns new arrays."""
    eng = _basics.engine_of(ps)
    handles = [eng.submit(n, "broadcast", _moved(np.array(a, copy=True)), root=root, lazy=True,
                          strict_join=True) for a, n in zip(arrays, names)]  # a copy: the engine broadcasts in place
    return [np.asarray(h.wait()).view(np.asarray(a).dtype).reshape(np.shape(a))
            for h, a in zip(handles, arrays)]


def allgather(x: np.ndarray, name: str, ps=None) -> np.ndarray:
    """Every rank's x concatenated along dim 0 (first dims may differ)."""
    out = _basics.engine_of(ps).submit(name, "allgather", _moved(x), lazy=True,
                                       strict_join=True).wait()
    return np.asarray(out).view(np.asarray(x).dtype)


def alltoall(x: np.ndarray, splits: Optional[Sequence[int]], name: str, ps=None):
    """Rows splits[j] go to rank j; returns (received rows, received splits as int32)."""
    out, recv = _basics.engine_of(ps).submit(name, "alltoall", _moved(x), splits=splits,
                                             lazy=True).wait()
    return np.asarray(out).view(np.asarray(x).dtype), np.asarray(recv, dtype=np.int32)


def allgather_group(arrays: Sequence[np.ndarray], names: Sequence[str], ps=None) -> list:
    """allgather of every array, submitted together (fused) and waited for together."""
    eng = _basics.engine_of(ps)
    handles = [eng.submit(n, "allgather", _moved(a), lazy=True, strict_join=True)
               for a, n in zip(arrays, names)]
    return [np.asarray(h.wait()).view(np.asarray(a).dtype) for h, a in zip(handles, arrays)]


def reducescatter_group(arrays: Sequence[np.ndarray], names: Sequence[str], op: ReduceOp,
                        prescale: float = 1.0, postscale: float = 1.0, ps=None) -> list:
    """reducescatter of every array, submitted together and waited for together."""
    eng = _basics.engine_of(ps)
    pending = [_submit_reduce(eng, "reducescatter", n, np.ascontiguousarray(a), ReduceOp(op),
                              prescale, postscale) for a, n in zip(arrays, names)]
    outs = [(np.asarray(h.wait()), plan) for h, plan in pending]
    return [o if plan is None else plan.finish(o, _basics.size_of(ps)) for o, plan in outs]


def reducescatter(x: np.ndarray, op: ReduceOp, name: str, prescale: float = 1.0,
                  postscale: float = 1.0, ps=None) -> np.ndarray:
    """Reduce over ranks, keep this rank's rows (the first ranks get one extra row)."""
    handle, plan = _submit_reduce(_basics.engine_of(ps), "reducescatter", name,
                                  np.ascontiguousarray(x), ReduceOp(op), prescale, postscale)
    out = np.asarray(handle.wait())
    return out if plan is None else plan.finish(out, _basics.size_of(ps))


def barrier(ps=None) -> None:
    """Return once every rank has called barrier()."""
    _basics.engine_of(ps).submit("barrier", "barrier", lazy=True).wait()


def join() -> int:
    """Wait until every rank has joined; returns the last rank to join."""
    return int(_basics.engine().join())


def broadcast_object(obj, root: int, name: str, ps=None):
    """root's (a world rank) obj on every rank (cloudpickled; every peer is authenticated)."""
    me = _basics.rank() == root
    sroot = _basics.root_of(ps, root, "broadcast_object")
    blob = cloudpickle.dumps(obj) if me else b""
    n = broadcast_group([np.array([len(blob)], np.int64)], [f"{name}.size"], sroot, ps)[0]
    buf = np.frombuffer(blob, np.uint8) if me else np.zeros(int(n[0]), np.uint8)
    buf = broadcast_group([buf], [name], sroot, ps)[0]
    return obj if me else cloudpickle.loads(buf.tobytes())


def allgather_object(obj, name: str, ps=None) -> list:
    """Every rank's obj, in rank order."""
    blob = np.frombuffer(cloudpickle.dumps(obj), np.uint8)
    sizes = allgather(np.array([blob.size], np.int64), f"{name}.size", ps)
    data = allgather(blob, name, ps).tobytes()
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    return [cloudpickle.loads(data[offsets[r]:offsets[r + 1]]) for r in range(len(sizes))]
