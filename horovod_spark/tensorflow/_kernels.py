"""The numpy kernels behind every TensorFlow op: arrays in, arrays out.

A *group* is a list of arrays reduced (or broadcast) as one op.  With the
fusion engine each array is submitted under its own name and the engine fuses
them; without it, the arrays of one dtype are packed into one flat *fusion
buffer*, sent as one collective and unpacked, so a model's gradients cost one
round trip per dtype either way.  Names label the arrays in errors.

Integer AVERAGE is a sum followed by floor division, as in Horovod; the
communicator refuses AVERAGE on integers, so it never sees one.
"""
from __future__ import annotations

import itertools
import threading
from typing import List, Optional, Sequence

import cloudpickle
import numpy as np

from collectives import NotSupported, ReduceOp
from collectives.errors import describe

from . import _basics

__all__ = ["allreduce_group", "submit_allreduce", "wait_allreduce", "broadcast_group", "allgather",
           "alltoall", "reducescatter", "barrier", "join", "broadcast_object", "allgather_object"]


def _integer_average(op: ReduceOp, dtype: np.dtype) -> bool:
    return op == ReduceOp.AVERAGE and not np.issubdtype(dtype, np.floating)


def _allreduce_one(comm, x: np.ndarray, op: ReduceOp, pre: float, post: float, name: str):
    if _integer_average(op, x.dtype):
        total = comm.allreduce(x, op=ReduceOp.SUM, name=name)
        return np.floor_divide(total, x.dtype.type(comm.size))
    return comm.allreduce(x, op=op, prescale=pre, postscale=post, name=name)


def _fused_label(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} (+{len(names) - 1} fused)"


def _by_dtype(arrays: Sequence[np.ndarray]) -> dict:
    groups: dict = {}
    for i, a in enumerate(arrays):
        groups.setdefault(a.dtype, []).append(i)
    return groups


def _pack(arrays: Sequence[np.ndarray], idx: List[int]) -> np.ndarray:
    if len(idx) == 1:
        return np.ascontiguousarray(arrays[idx[0]])
    return np.concatenate([arrays[i].reshape(-1) for i in idx])


def _unpack(flat: np.ndarray, arrays: Sequence[np.ndarray], idx: List[int], out: list) -> None:
    if len(idx) == 1:
        out[idx[0]] = flat.reshape(arrays[idx[0]].shape)
        return
    offset = 0
    for i in idx:
        n = arrays[i].size
        out[i] = flat[offset:offset + n].reshape(arrays[i].shape)
        offset += n


def allreduce_group(arrays: Sequence[np.ndarray], names: Sequence[str], op: ReduceOp,
                    prescale: float = 1.0, postscale: float = 1.0) -> list:
    """Reduce every array over ranks; returns new arrays in the same order."""
    comm = _basics.communicator()
    eng = _basics.engine()
    op = ReduceOp(op)
    if eng is not None:
        return _engine_allreduce(eng, comm, arrays, names, op, prescale, postscale)
    out: list = [None] * len(arrays)
    for _, idx in _by_dtype(arrays).items():
        flat = _pack(arrays, idx)
        red = _allreduce_one(comm, flat, op, prescale, postscale, _fused_label([names[i] for i in idx]))
        _unpack(red, arrays, idx, out)
    return out


def _engine_allreduce(eng, comm, arrays, names, op, pre, post) -> list:
    handles = []
    for a, n in zip(arrays, names):
        a = np.ascontiguousarray(a)
        if _integer_average(op, a.dtype):
            handles.append((eng.submit(n, "allreduce", a, op=ReduceOp.SUM), True))
        else:
            handles.append((eng.submit(n, "allreduce", a, op=op, prescale=pre, postscale=post), False))
    out = []
    for (h, floor), a in zip(handles, arrays):
        r = np.asarray(h.wait()).reshape(a.shape)
        out.append(np.floor_divide(r, a.dtype.type(comm.size)) if floor else r)
    return out


# -- split allreduce: submit each tensor as soon as it exists, wait for all later --
_lock = threading.Lock()
_tokens = itertools.count(1)
_submitted: dict = {}  # token -> (handle, shape, dtype to floor-divide by size, or None)
_token_of: dict = {}   # name -> token of its latest submission


def submit_allreduce(a: np.ndarray, name: str, op: ReduceOp, prescale: float = 1.0,
                     postscale: float = 1.0) -> int:
    """Hand one array to the engine; returns the token wait_allreduce takes.

    The engine keeps a reference to `a` until the op is done, so a buffer
    lent by TensorFlow stays alive (and unchanged) until then.
    """
    eng = _basics.engine()
    op = ReduceOp(op)
    floor = _integer_average(op, a.dtype)
    _await_previous(name)
    if floor:
        handle = eng.submit(name, "allreduce", a, op=ReduceOp.SUM)
    else:
        handle = eng.submit(name, "allreduce", a, op=op, prescale=prescale, postscale=postscale)
    with _lock:
        token = next(_tokens)
        _submitted[token] = (handle, a.shape, a.dtype if floor else None)
        _token_of[name] = token
    return token


def _await_previous(name: str) -> None:
    """An earlier submission of `name` not yet waited for (the same graph running again
    before its wait ran, or a graph that failed midway) must finish before the engine
    takes the name again; its result stays for its own wait."""
    with _lock:
        entry = _submitted.get(_token_of.get(name))
    if entry is not None:
        try:
            entry[0].wait()
        except Exception:  # noqa: BLE001  reported to its own waiter, if any
            pass


def wait_allreduce(tokens: Sequence[int]) -> list:
    """The results of submit_allreduce calls, in the order of `tokens`."""
    with _lock:
        entries = [_submitted.pop(int(t)) for t in tokens]
        done = {int(t) for t in tokens}
        for name in [n for n, t in _token_of.items() if t in done]:
            del _token_of[name]
    size = _basics.size()
    out = []
    for handle, shape, floor_dtype in entries:
        r = np.asarray(handle.wait()).reshape(shape)
        out.append(r if floor_dtype is None else np.floor_divide(r, floor_dtype.type(size)))
    return out


def broadcast_group(arrays: Sequence[np.ndarray], names: Sequence[str], root: int) -> list:
    """Every array as root has it; returns new arrays."""
    comm = _basics.communicator()
    eng = _basics.engine()
    if eng is not None:
        hs = [eng.submit(n, "broadcast", np.array(a, copy=True), root=root) for a, n in zip(arrays, names)]
        return [np.asarray(h.wait()).reshape(a.shape) for h, a in zip(hs, arrays)]
    out: list = [None] * len(arrays)
    for _, idx in _by_dtype(arrays).items():
        flat = np.array(_pack(arrays, idx), copy=True)  # broadcast writes in place
        comm.broadcast(flat, root=root, name=_fused_label([names[i] for i in idx]))
        _unpack(flat, arrays, idx, out)
    return out


def allgather(x: np.ndarray, name: str) -> np.ndarray:
    """Every rank's x concatenated along dim 0 (first dims may differ)."""
    eng = _basics.engine()
    if eng is not None:
        return np.asarray(eng.submit(name, "allgather", np.ascontiguousarray(x)).wait())
    return _basics.communicator().allgather(x, name=name)


def alltoall(x: np.ndarray, splits: Optional[Sequence[int]], name: str):
    """Rows splits[j] go to rank j; returns (received rows, received splits as int32)."""
    eng = _basics.engine()
    if eng is not None:
        out, recv = eng.submit(name, "alltoall", np.ascontiguousarray(x), splits=splits).wait()
    else:
        out, recv = _basics.communicator().alltoall(x, splits=splits, name=name)
    return np.asarray(out), np.asarray(recv, dtype=np.int32)


def reducescatter(x: np.ndarray, op: ReduceOp, name: str) -> np.ndarray:
    """Reduce over ranks, keep this rank's rows (the first ranks get one extra row)."""
    comm = _basics.communicator()
    eng = _basics.engine()
    op = ReduceOp(op)
    rop = ReduceOp.SUM if _integer_average(op, x.dtype) else op
    if eng is not None:
        out = np.asarray(eng.submit(name, "reducescatter", np.ascontiguousarray(x), op=rop).wait())
    else:
        out = comm.reducescatter(x, op=rop, name=name)
    return np.floor_divide(out, x.dtype.type(comm.size)) if rop != op else out


def barrier() -> None:
    """Return once every rank has called barrier()."""
    eng = _basics.engine()
    if eng is not None:
        eng.submit("barrier", "barrier", np.zeros(0, np.uint8)).wait()
    else:
        _basics.communicator().barrier()


def join() -> int:
    """Wait until every rank has joined; returns the last rank to join."""
    comm = _basics.communicator()
    eng = _basics.engine()
    if eng is None:
        raise NotSupported(describe("join needs the fusion engine, which this install lacks",
                                    rank=comm.rank, size=comm.size, op="join"))
    return int(eng.join())


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
