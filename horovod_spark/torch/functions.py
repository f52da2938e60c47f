"""Whole-model helpers: broadcast parameters, optimizer state and Python objects.

Objects travel cloudpickled through the engine (every peer of the
communicator is authenticated with the job secret before any byte is read,
so unpickling here never reads an unauthenticated peer's bytes): first the
byte length, then the bytes.
"""
from __future__ import annotations

import cloudpickle
import numpy as np
import torch

from . import _state
from . import mpi_ops as M

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
           "allgather_object"]


def broadcast_parameters(params, root_rank: int = 0, prefix=None,
                         process_set=M.global_process_set) -> None:
    """Overwrite every tensor in `params` with root_rank's, in place.

    Args:
        params: a state_dict, or a list of tensors or (name, tensor) pairs
            (e.g. model.named_parameters()).
        root_rank: a world rank (a member of `process_set`).
        process_set: the ranks that take part (every rank by default).
    """
    _state.view(process_set, "broadcast_parameters")
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, (list, tuple)) or hasattr(params, "__iter__"):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type {type(params).__name__}; pass a state_dict or "
                         "a list of (name, tensor)")
    handles = []
    with _state.waiting_now():  # all submitted, then all waited for
        _submit_broadcasts(items, root_rank, prefix, handles, process_set)
    for h in handles:
        M.synchronize(h)


def _submit_broadcasts(items, root_rank: int, prefix, handles: list, process_set) -> None:
    for i, (name, p) in enumerate(items):
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"broadcast_parameters: {name or i!r} is a {type(p).__name__}, not a tensor")
        label = name if name is not None else f"param.{i}"
        handles.append(M.broadcast_async_(p.data, root_rank,
                                          name=f"{prefix or 'params'}.{label}",
                                          process_set=process_set))


def broadcast_optimizer_state(optimizer, root_rank: int = 0, prefix: str = "Parameter.",
                              model=None, process_set=M.global_process_set) -> None:
    """Make every rank's (of `process_set`) optimizer state and hyperparameters root_rank's."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if not optimizer.state_dict()["state"]:
        _init_state(optimizer)
    state = broadcast_object(optimizer.state_dict(), root_rank, name=f"{prefix}optimizer_state",
                             process_set=process_set)
    if _state.rank() != root_rank:
        optimizer.load_state_dict(state)


def _init_state(optimizer) -> None:
    """A new optimizer's state made as Horovod makes it before broadcasting it: a zero
    gradient for every parameter that takes one (sparse for SparseAdam), then one step of
    the wrapped optimizer alone (a DistributedOptimizer's own step would reduce, and a rank
    that called it alone would wait for the others)."""
    from .optimizer import _DistributedOptimizer, _LocalOptimizer

    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = p.data.new(p.size()).zero_()
                if isinstance(optimizer, torch.optim.SparseAdam):
                    p.grad = p.grad.to_sparse()
    for mixin in (_DistributedOptimizer, _LocalOptimizer):
        if isinstance(optimizer, mixin):
            super(mixin, optimizer).step()
            return
    optimizer.step()


def broadcast_object(obj, root_rank: int = 0, name=None, process_set=M.global_process_set):
    """root_rank's (a world rank) obj on every rank of the set (any cloudpickle-able object)."""
    ps = _state.view(process_set, "broadcast_object")
    base = _state.op_name("broadcast_object", name, ps)
    root = M._root(ps, root_rank, "broadcast_object")
    if _state.rank() == root_rank:
        payload = np.frombuffer(cloudpickle.dumps(obj), np.uint8).copy()
        length = np.array([payload.size], np.int64)
    else:
        payload, length = None, np.zeros(1, np.int64)
    eng = _state.engine() if ps is None else ps  # every op here is waited for at once: lazy
    eng.submit(f"{base}.length", "broadcast", length, out=length, root=root, lazy=True).wait()
    if payload is None:
        payload = np.empty(int(length[0]), np.uint8)
    eng.submit(f"{base}.bytes", "broadcast", payload, out=payload, root=root, lazy=True).wait()
    return obj if _state.rank() == root_rank else cloudpickle.loads(payload.tobytes())


def allgather_object(obj, name=None, process_set=M.global_process_set) -> list:
    """Every rank's (of the set) obj, in rank order."""
    ps = _state.view(process_set, "allgather_object")
    base = _state.op_name("allgather_object", name, ps)
    payload = np.frombuffer(cloudpickle.dumps(obj), np.uint8)
    eng = _state.engine() if ps is None else ps  # every op here is waited for at once: lazy
    lengths = np.asarray(eng.submit(f"{base}.lengths", "allgather",
                                    np.array([payload.size], np.int64), lazy=True).wait())
    blob = np.asarray(eng.submit(f"{base}.bytes", "allgather", payload, lazy=True).wait())
    out, off = [], 0
    for n in lengths.tolist():
        out.append(cloudpickle.loads(blob[off:off + n].tobytes()))
        off += n
    return out
