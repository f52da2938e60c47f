"""The numpy kernels behind every TensorFlow op: arrays in, arrays out.

Every kernel goes through the fusion engine that init() started, so TensorFlow
ops are negotiated, fused, timed and checked exactly like torch's.  A *group*
is a list of arrays submitted together, each under its own name, and waited
for together; the engine fuses them into one collective per dtype (up to the
fusion threshold), so a model's gradients cost one engine cycle per step.

Integer AVERAGE is a sum followed by floor division, as in Horovod; the engine
refuses AVERAGE on integers, so it never sees one.  Every kernel waits for its
ops at once, so it submits them `lazy`: the wait runs the engine's cycle on
this thread (TensorFlow's), with no hand-over to the engine's thread.
"""
from __future__ import annotations

from typing import Optional, Sequence

import cloudpickle
import numpy as np

from collectives import ReduceOp

from . import _basics

__all__ = ["allreduce_group", "broadcast_group", "allgather", "alltoall", "reducescatter",
           "barrier", "join", "broadcast_object", "allgather_object"]


def _integer_average(op: ReduceOp, dtype: np.dtype) -> bool:
    return op == ReduceOp.AVERAGE and not np.issubdtype(dtype, np.floating)


def allreduce_group(arrays: Sequence[np.ndarray], names: Sequence[str], op: ReduceOp,
                    prescale: float = 1.0, postscale: float = 1.0) -> list:
    """Reduce every array over ranks; returns new arrays in the same order."""
    eng = _basics.engine()
    op = ReduceOp(op)
    pending = []
    for a, name in zip(arrays, names):
        flat = np.ascontiguousarray(a)  # 0-d arrays come back 1-d: keep the shape apart
        if _integer_average(op, flat.dtype):
            handle = eng.submit(name, "allreduce", flat, op=ReduceOp.SUM, lazy=True)
        else:
            handle = eng.submit(name, "allreduce", flat, op=op, prescale=prescale,
                                postscale=postscale, lazy=True)
        pending.append((handle, np.shape(a), _integer_average(op, flat.dtype)))
    out = []
    for handle, shape, floor in pending:
        r = np.asarray(handle.wait()).reshape(shape)
        out.append(np.floor_divide(r, r.dtype.type(_basics.size())) if floor else r)
    return out


def broadcast_group(arrays: Sequence[np.ndarray], names: Sequence[str], root: int) -> list:
    """Every array as root has it; returns new arrays."""
    eng = _basics.engine()
    handles = [eng.submit(n, "broadcast", np.array(a, copy=True), root=root, lazy=True)  # in place
               for a, n in zip(arrays, names)]
    return [np.asarray(h.wait()).reshape(np.shape(a)) for h, a in zip(handles, arrays)]


def allgather(x: np.ndarray, name: str) -> np.ndarray:
    """Every rank's x concatenated along dim 0 (first dims may differ)."""
    return np.asarray(_basics.engine().submit(name, "allgather", np.ascontiguousarray(x),
                                              lazy=True).wait())


def alltoall(x: np.ndarray, splits: Optional[Sequence[int]], name: str):
    """Rows splits[j] go to rank j; returns (received rows, received splits as int32)."""
    out, recv = _basics.engine().submit(name, "alltoall", np.ascontiguousarray(x),
                                        splits=splits, lazy=True).wait()
    return np.asarray(out), np.asarray(recv, dtype=np.int32)


def reducescatter(x: np.ndarray, op: ReduceOp, name: str) -> np.ndarray:
    """Reduce over ranks, keep this rank's rows (the first ranks get one extra row)."""
    op = ReduceOp(op)
    rop = ReduceOp.SUM if _integer_average(op, x.dtype) else op
    out = np.asarray(_basics.engine().submit(name, "reducescatter", np.ascontiguousarray(x),
                                             op=rop, lazy=True).wait())
    return np.floor_divide(out, x.dtype.type(_basics.size())) if rop != op else out


def barrier() -> None:
    """Return once every rank has called barrier()."""
    _basics.engine().submit("barrier", "barrier", lazy=True).wait()


def join() -> int:
    """Wait until every rank has joined; returns the last rank to join."""
    return int(_basics.engine().join())


def broadcast_object(obj, root: int, name: str):
    """root's obj on every rank (cloudpickled; every peer is authenticated)."""
    comm = _basics.communicator()
    blob = cloudpickle.dumps(obj) if comm.rank == root else b""
    n = broadcast_group([np.array([len(blob)], np.int64)], [f"{name}.size"], root)[0]
    buf = np.frombuffer(blob, np.uint8) if comm.rank == root else np.zeros(int(n[0]), np.uint8)
    buf = broadcast_group([buf], [name], root)[0]
    return obj if comm.rank == root else cloudpickle.loads(buf.tobytes())


def allgather_object(obj, name: str) -> list:
    """Every rank's obj, in rank order."""
    blob = np.frombuffer(cloudpickle.dumps(obj), np.uint8)
    sizes = allgather(np.array([blob.size], np.int64), f"{name}.size")
    data = allgather(blob, name).tobytes()
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    return [cloudpickle.loads(data[offsets[r]:offsets[r + 1]]) for r in range(len(sizes))]
