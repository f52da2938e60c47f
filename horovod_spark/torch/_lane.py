"""Blocking allreduces of CPU tensors through the engine's lane (`collectives.fusion.lane`).

`hvd.allreduce_(t, name=...)` and `hvd.allreduce(t, name=...)` block: in Horovod scripts
they average a metric or a loss each step, under the same name.  Through the engine each
such op is a request, a cycle driven on the caller's thread and a wait, all in Python
(about 50 us a call on two ranks, more than the collective of a small tensor).  The
engine's lane runs that steady state in C++: the first call of a name goes through the
engine as before (`FusionEngine.lane_op`) and arms a slot with its cache bit; later calls
with the same name, dtype, shape, op and postscale run as one `Lane.run_at` on the
tensors' addresses, with the GIL released, and pair with ranks whose engines run the
same cycle in Python.  A cycle the lane cannot decide alone (a peer joined, announced a
new name, holds other work) is handed to the engine, which finishes it.

Async ops (`allreduce_async_`, and each member of a named grouped allreduce, in place
or on a copy) queue in the lane once their slot is armed (`FusionEngine.lane_enqueue`);
`synchronize` runs the lane's batch cycles (`LaneHandle`).

Only what the lane reduces exactly as the engine does takes this path: a named op on
the global process set, Sum or Average, no prescale, a contiguous CPU tensor of
float16/32/64 with at least one element, an engine with a lane (the native backend).
Everything else, and every op with HOROVOD_SPARK_TORCH_LANE=0, takes the engine's path.
"""
from __future__ import annotations

import threading
from typing import Dict, Optional

import torch

from collectives.fusion.lane import codes as lane_codes
from collectives.types import ReduceOp

from ..settings import TORCH_LANE
from . import _state

__all__ = ["allreduce", "allreduce_async_", "MAX_SLOTS"]

_DTYPES = frozenset((torch.float16, torch.float32, torch.float64))
_OPS = (ReduceOp.SUM, ReduceOp.AVERAGE)
MAX_SLOTS = 4096  # distinct (name, dtype, shape, op, postscale); beyond, the engine's path


class _Slots:
    """One engine's lane and the slot of every key it has seen (a new engine after
    shutdown/init or an elastic reset gets a new table)."""

    __slots__ = ("engine", "lane", "table", "done")

    def __init__(self, engine) -> None:
        self.engine = engine
        self.lane = engine.lane if TORCH_LANE.read() else None
        self.table: Dict[tuple, int] = {}
        self.done = lane_codes()["done"] if self.lane is not None else None


_current: list = [None]
_lock = threading.Lock()


def _slots() -> _Slots:
    eng = _state.engine()
    cur = _current[0]
    if cur is None or cur.engine is not eng:
        cur = _current[0] = _Slots(eng)
    return cur


def _applies(tensor: torch.Tensor, name: Optional[str], op, pre: float, post: float) -> bool:
    """What the lane reduces as the engine does (the caller checks for the global set)."""
    return not (name is None or pre != 1.0 or op not in _OPS or tensor.dtype not in _DTYPES
                or tensor.device.type != "cpu" or not tensor.is_contiguous()
                or (tensor.dtype == torch.float16 and post != 1.0)  # scaled in float32 (mpi_ops)
                or tensor.numel() == 0)


def _slot(s: _Slots, key: tuple) -> Optional[int]:
    slot = s.table.get(key)
    if slot is None:
        with _lock:  # two threads must not take one slot number for two keys
            slot = s.table.get(key)
            if slot is None:
                if len(s.table) >= MAX_SLOTS:
                    return None
                slot = s.table[key] = len(s.table)
    return slot


def allreduce(tensor: torch.Tensor, name: Optional[str], op, pre: float, post: float,
              inplace: bool, process_set) -> Optional[torch.Tensor]:
    """`tensor` reduced through the lane: into itself (inplace) or a new tensor; None where
    this path does not apply (nothing was done: the caller's path runs)."""
    if not _applies(tensor, name, op, pre, post) or \
            _state.view(process_set, "allreduce") is not None:  # the global set only
        return None
    n = tensor.numel()
    s = _slots()
    if s.lane is None:
        return None
    full = "allreduce." + name
    key = (full, tensor.dtype, tuple(tensor.shape), op, post)
    slot = _slot(s, key)
    if slot is None:
        return None
    dst = tensor if inplace else torch.empty_like(tensor, memory_format=torch.contiguous_format)
    code = s.lane.run_at(slot, tensor.data_ptr(), dst.data_ptr(), n * tensor.element_size())
    if code != s.done:  # first run, a stale or switched-off slot, a handover or an error
        src = tensor.detach().numpy()
        with _state.refused_as_invalid_argument():  # as _state.submit refuses an argument
            s.engine.lane_op(code, slot, full, src, src if inplace else dst.numpy(), op, post)
    return dst


class LaneHandle:
    """An async op queued in the lane (`FusionEngine.lane_enqueue`): wait runs the lane's
    batch cycles (or the engine's, once it took the op over)."""

    __slots__ = ("engine", "ticket", "tensor")

    def __init__(self, engine, ticket: int, tensor: torch.Tensor) -> None:
        self.engine, self.ticket, self.tensor = engine, ticket, tensor

    def poll(self) -> bool:
        return self.engine.lane_poll(self.ticket)

    def wait(self) -> torch.Tensor:
        self.engine.lane_wait(self.ticket)
        return self.tensor


def applies_async(tensor: torch.Tensor, full: Optional[str], op, pre: float, post: float) -> bool:
    """Whether `allreduce_async_` may take this op (it still may not, once it looks)."""
    return _applies(tensor, full, op, pre, post) and _slots().lane is not None


def allreduce_async_(tensor: torch.Tensor, full: Optional[str], op, pre: float, post: float):
    """An in-place async allreduce on the global set through the lane, `full` the op's
    name (None: an unnamed op, which gets a new name each call: not for the lane):
    (LaneHandle, None) once its slot is armed and the engine holds nothing else; else
    (None, arm) where the path applies (arm(handle) arms the slot after the engine ran
    the op), or None."""
    if not _applies(tensor, full, op, pre, post):
        return None
    s = _slots()
    if s.lane is None:
        return None
    slot = _slot(s, (full, tensor.dtype, tuple(tensor.shape), op, post))
    if slot is None:
        return None
    eng = s.engine
    ticket = eng.lane_enqueue(slot, full, tensor, tensor.data_ptr(),
                              tensor.numel() * tensor.element_size(), op, post)
    if ticket >= 0:
        return LaneHandle(eng, ticket, tensor), None
    if ticket == -2:
        return None

    def arm(handle) -> None:
        lane = eng._lane
        if lane is not None:
            lane.arm(slot, handle._sig, tensor.detach().numpy(), post, eng.size)
    return None, arm
