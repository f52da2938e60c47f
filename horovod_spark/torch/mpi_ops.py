"""The async ops of Horovod's torch API, over the fusion engine.

Each `*_async` call submits one named op to the engine and returns a
`TorchHandle`; `synchronize(handle)` waits and returns the result tensor(s),
`poll(handle)` says whether it is done.  Names follow Horovod:
'allreduce.<name>', or 'allreduce.noname.<n>' in call order, so ranks that
call the same ops in the same order match without names.  The in-place
variants (trailing underscore) write into the given tensor.

Horovod semantics kept: Average is the default reduce op; an integer tensor
averages by floor division; alltoall returns received splits as int32.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import numpy as np
import torch

from collectives.errors import NotSupported
from collectives.types import ReduceOp

from . import _state

__all__ = ["Average", "Sum", "Adasum", "Min", "Max", "Product", "TorchHandle", "ProcessSet",
           "global_process_set", "allreduce_async", "allreduce_async_", "grouped_allreduce_async",
           "grouped_allreduce_async_", "allgather_async", "broadcast_async", "broadcast_async_",
           "alltoall_async", "reducescatter_async", "grouped_allgather_async",
           "grouped_reducescatter_async", "add_process_set", "remove_process_set",
           "synchronize", "poll", "join", "barrier",
           "handle_average_backwards_compatibility"]

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
Adasum = "Adasum"  # recognised so the refusal can name it


class ProcessSet:
    """Only the global process set is supported; it exists for signature compatibility."""

    def __repr__(self) -> str:
        return "global_process_set"


global_process_set = ProcessSet()


class TorchHandle:
    """Handle of one async op (or a group): `synchronize(h)` / `poll(h)`."""

    __slots__ = ("_handles", "_finish", "_value", "_done")

    def __init__(self, handles: list, finish: Callable[[list], object]) -> None:
        self._handles, self._finish = handles, finish
        self._done, self._value = False, None

    def poll(self) -> bool:
        return self._done or all(h.poll() for h in self._handles)

    def wait(self):
        if not self._done:
            self._value = self._finish([h.wait() for h in self._handles])
            self._done, self._handles = True, []
        return self._value


def _check_process_set(process_set) -> None:
    if process_set is not None and process_set is not global_process_set:
        raise NotSupported("process sets other than the global one are not supported")


def handle_average_backwards_compatibility(op, average):
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average; please provide only one of them")
    if op is None:
        op = Average if average is None or average else Sum
    if type(op) is ReduceOp:
        return op
    if op == Adasum:
        raise NotSupported("Adasum is not supported by horovod_spark; use op=hvd.Average")
    return ReduceOp(op)


def _integer_average(tensor: torch.Tensor, op: ReduceOp) -> bool:
    return op == Average and not (tensor.dtype.is_floating_point or tensor.is_complex())


def _reduce_finish(op_avg_int: bool, inplace: Optional[torch.Tensor]):
    def finish(results):
        out = results[0]
        if op_avg_int:
            out.floor_divide_(_state.size())
        return inplace if inplace is not None else out
    return finish


def _allreduce_submit(tensor, out, name, op, prescale, postscale):
    int_avg = _integer_average(tensor, op)
    return _state.submit(name, "allreduce", tensor, out=out,
                                  op=Sum if int_avg else op, prescale=prescale,
                                  postscale=postscale), int_avg


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set) -> TorchHandle:
    """Reduce `tensor` over ranks into a new tensor (the input is not modified)."""
    _check_process_set(process_set)
    op = handle_average_backwards_compatibility(op, average)
    h, int_avg = _allreduce_submit(tensor, None, _state.op_name("allreduce", name), op,
                                   prescale_factor, postscale_factor)
    return TorchHandle([h], _reduce_finish(int_avg, None))


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set) -> TorchHandle:
    """Reduce `tensor` over ranks in place."""
    _check_process_set(process_set)
    op = handle_average_backwards_compatibility(op, average)
    h, int_avg = _allreduce_submit(tensor, tensor, _state.op_name("allreduce", name), op,
                                   prescale_factor, postscale_factor)
    return TorchHandle([h], _reduce_finish(int_avg, tensor))


def _grouped(tensors: Sequence[torch.Tensor], inplace: bool, name, op, pre, post) -> TorchHandle:
    base = _state.op_name("grouped_allreduce", name)
    handles, floors = [], []
    for i, t in enumerate(tensors):
        h, int_avg = _allreduce_submit(t, t if inplace else None, f"{base}.{i}", op, pre, post)
        handles.append(h)
        floors.append(int_avg)

    def finish(results):
        out = []
        for t, r, floor in zip(tensors, results, floors):
            if floor:
                r.floor_divide_(_state.size())
            out.append(t if inplace else r)
        return out
    return TorchHandle(handles, finish)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set) -> TorchHandle:
    """Reduce a list of tensors as one group; synchronize returns a list."""
    _check_process_set(process_set)
    op = handle_average_backwards_compatibility(op, average)
    return _grouped(tensors, False, name, op, prescale_factor, postscale_factor)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> TorchHandle:
    _check_process_set(process_set)
    op = handle_average_backwards_compatibility(op, average)
    return _grouped(tensors, True, name, op, prescale_factor, postscale_factor)


def allgather_async(tensor, name=None, process_set=global_process_set) -> TorchHandle:
    """Concatenate every rank's tensor along dim 0 (first dimensions may differ)."""
    _check_process_set(process_set)
    h = _state.submit(_state.op_name("allgather", name), "allgather", tensor)
    return TorchHandle([h], lambda r: r[0])


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> TorchHandle:
    """root_rank's tensor on every rank, in a new tensor."""
    _check_process_set(process_set)
    h = _state.submit(_state.op_name("broadcast", name), "broadcast", tensor,
                               root=root_rank)
    return TorchHandle([h], lambda r: r[0])


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> TorchHandle:
    """root_rank's tensor on every rank, written in place."""
    _check_process_set(process_set)
    h = _state.submit(_state.op_name("broadcast", name), "broadcast", tensor,
                               out=tensor, root=root_rank)
    return TorchHandle([h], lambda r: tensor)


def _splits_list(splits) -> Optional[List[int]]:
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        splits = splits.cpu().tolist()
    return [int(s) for s in splits]


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> TorchHandle:
    """Rows splits[j] go to rank j; synchronize returns (output, received_splits)."""
    _check_process_set(process_set)
    h = _state.submit(_state.op_name("alltoall", name), "alltoall", tensor,
                               splits=_splits_list(splits))

    def finish(results):
        out, recv = results[0]
        return out, torch.from_numpy(np.asarray(recv, dtype=np.int32))
    return TorchHandle([h], finish)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0) -> TorchHandle:
    """Reduce over ranks, keep this rank's rows of dim 0 (the first ranks get one extra)."""
    _check_process_set(process_set)
    op = handle_average_backwards_compatibility(op, None)
    int_avg = _integer_average(tensor, op)
    h = _state.submit(_state.op_name("reducescatter", name), "reducescatter", tensor,
                               op=Sum if int_avg else op, prescale=prescale_factor,
                               postscale=postscale_factor)
    return TorchHandle([h], _reduce_finish(int_avg, None))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> TorchHandle:
    """allgather of each tensor, submitted together; synchronize returns a list."""
    _check_process_set(process_set)
    base = _state.op_name("grouped_allgather", name)
    return TorchHandle([_state.submit(f"{base}.{i}", "allgather", t) for i, t in enumerate(tensors)],
                       list)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> TorchHandle:
    """reducescatter of each tensor, submitted together; synchronize returns a list."""
    _check_process_set(process_set)
    op = handle_average_backwards_compatibility(op, None)
    base = _state.op_name("grouped_reducescatter", name)
    handles, floors = [], []
    for i, t in enumerate(tensors):
        int_avg = _integer_average(t, op)
        handles.append(_state.submit(f"{base}.{i}", "reducescatter", t,
                                              op=Sum if int_avg else op, prescale=prescale_factor,
                                              postscale=postscale_factor))
        floors.append(int_avg)

    def finish(results):
        return [r.floor_divide_(_state.size()) if f else r for r, f in zip(results, floors)]
    return TorchHandle(handles, finish)


def add_process_set(process_set):
    raise NotSupported("process sets are not supported by horovod_spark; every op runs on "
                       "the global process set")


def remove_process_set(process_set):
    raise NotSupported("process sets are not supported by horovod_spark")


def synchronize(handle: TorchHandle):
    """Wait for an async op; returns its output (a tensor, a tuple or a list)."""
    if not isinstance(handle, TorchHandle):
        raise TypeError(f"synchronize() takes a handle from an *_async op, got {type(handle).__name__}")
    return handle.wait()


def poll(handle: TorchHandle) -> bool:
    """True once synchronize(handle) would not block."""
    return handle.poll()


def join(device=-1) -> int:
    """This rank has no more data: until every rank joins, it contributes zeros.

    Returns the rank that joined last.
    """
    return int(_state.engine().join())


def barrier(process_set=global_process_set) -> None:
    """Return once every rank has called barrier()."""
    _check_process_set(process_set)
    with _state.waiting_now():
        handle = _state.submit(_state.op_name("barrier", None), "barrier")
    handle.wait()
