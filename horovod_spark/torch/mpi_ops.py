"""The async ops of Horovod's torch API, over the fusion engine.

Each `*_async` call submits one named op to the engine and returns a
`TorchHandle`; `synchronize(handle)` waits and returns the result tensor(s),
`poll(handle)` says whether it is done.  Names follow Horovod:
'allreduce.<name>', or 'allreduce.noname.<n>' in call order, so ranks that
call the same ops in the same order match without names.  The in-place
variants (trailing underscore) write into the given tensor.

Horovod semantics kept: Average is the default reduce op; an integer tensor
averages by division truncated toward zero, and scales (prescale, postscale)
in float64 truncated back to its dtype; alltoall returns received splits as
int32.  The engine reduces floating tensors only with factors, so integer
scaling happens here, around a plain sum.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import numpy as np
import torch

from collectives.adasum import ADASUM, is_adasum
from collectives.errors import NotSupported
from collectives.types import ReduceOp

from ..common.process_sets import ProcessSet
from . import _lane, _state
from . import adasum as _adasum
from ._errors import InvalidArgument

__all__ = ["Average", "Sum", "Adasum", "Min", "Max", "Product", "TorchHandle", "ProcessSet",
           "global_process_set", "allreduce_async", "allreduce_async_", "grouped_allreduce_async",
           "grouped_allreduce_async_", "allgather_async", "broadcast_async", "broadcast_async_",
           "alltoall_async", "reducescatter_async", "grouped_allgather_async",
           "grouped_reducescatter_async", "sparse_allreduce_async", "add_process_set", "remove_process_set",
           "synchronize", "poll", "join", "barrier",
           "handle_average_backwards_compatibility", "InvalidArgument"]

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
Adasum = ADASUM  # combined by the adaptive-sum tree (see collectives.adasum)


global_process_set = _state.global_process_set


class TorchHandle:
    """Handle of one async op (or a group): `synchronize(h)` / `poll(h)`."""

    __slots__ = ("_handles", "_finish", "_value", "_done")

    def __init__(self, handles: list, finish: Callable[[list], object]) -> None:
        self._handles, self._finish = handles, finish
        self._done, self._value = False, None

    def poll(self) -> bool:
        return self._done or all(h.poll() for h in self._handles)

    def __call__(self):
        """synchronize(h): Horovod's sparse_allreduce_async hands back a function to call
        for the result, so every handle here can be called the same way."""
        return self.wait()

    def wait(self):
        if not self._done:
            self._value = self._finish([h.wait() for h in self._handles])
            self._done, self._handles = True, []
        return self._value


def handle_average_backwards_compatibility(op, average):
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average; please provide only one of them")
    if op is None:
        op = Average if average is None or average else Sum
    if type(op) is ReduceOp:
        return op
    if is_adasum(op):
        return Adasum
    return ReduceOp(op)


def _is_integer(tensor: torch.Tensor) -> bool:
    return not (tensor.dtype.is_floating_point or tensor.is_complex() or tensor.dtype == torch.bool)


def _scale_int(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """Horovod's integer scaling: the product in float64, truncated to the dtype."""
    return (tensor.double() * factor).trunc().to(tensor.dtype)


def _scale_half(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """Horovod's CPU half-precision scaling: the product in float32, rounded to the dtype."""
    return (tensor.float() * float(np.float32(factor))).to(tensor.dtype)


class _Plan:
    """How a tensor reduces whose scaling the engine would not do as Horovod does (integers:
    the product in float64, truncated; CPU float16/bfloat16: in float32, rounded once, where
    the engine scales in the tensor's own precision): the input scaled by `scale`, the op
    the engine runs (Average as Sum), and what finish() does to the result (one scaling, as
    Horovod folds 1/size into the postscale; an integer Average alone divides exactly)."""

    __slots__ = ("input", "op", "average", "post", "scale")

    def __init__(self, tensor: torch.Tensor, op: ReduceOp, pre: float, post: float,
                 scale: Callable[[torch.Tensor, float], torch.Tensor]) -> None:
        self.scale = scale
        self.input = scale(tensor, pre) if pre != 1.0 else tensor
        self.average = op == Average
        self.op = Sum if self.average else op
        self.post = post

    def finish(self, out: torch.Tensor, n: int) -> torch.Tensor:
        if self.average and self.post == 1.0 and self.scale is _scale_int:
            return out.copy_(torch.div(out, n, rounding_mode="trunc"))
        post = self.post / (n if self.average else 1)
        return out.copy_(self.scale(out, post)) if post != 1.0 else out


def _plan(tensor, op, pre, post) -> Optional[_Plan]:
    """The integer or half-precision plan of a reduction, or None (the engine does it all)."""
    if _is_integer(tensor):
        return None if op != Average and pre == 1.0 and post == 1.0 else \
            _Plan(tensor, op, pre, post, _scale_int)
    if tensor.dtype in (torch.float16, torch.bfloat16) and not tensor.is_cuda and \
            (pre != 1.0 or post != 1.0) and op in (Sum, Average):
        return _Plan(tensor, op, pre, post, _scale_half)
    return None


def _first(results):
    return results[0]


def _reduce_finish(plan: Optional[_Plan], inplace: Optional[torch.Tensor], ps=None):
    if plan is None:  # the engine's result: a new tensor, or `inplace` itself (its out=)
        return _first

    def finish(results):
        out = results[0] if plan is None else plan.finish(results[0], _state.set_size(ps))
        return inplace if inplace is not None else out
    return finish


def _reduce_submit(kind, tensor, out, name, op, prescale, postscale, ps=None):
    """Submit one allreduce or reducescatter; returns (handle, plan or None)."""
    plan = _plan(tensor, op, prescale, postscale)
    if plan is None:
        return _state.submit(name, kind, tensor, out=out, op=op, prescale=prescale,
                             postscale=postscale, view=ps), None
    return _state.submit(name, kind, plan.input, out=out, op=plan.op, view=ps), plan


def _allreduce_submit(tensor, out, name, op, prescale, postscale, ps=None):
    return _reduce_submit("allreduce", tensor, out, name, op, prescale, postscale, ps)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set) -> TorchHandle:
    """Reduce `tensor` over ranks into a new tensor (the input is not modified)."""
    ps = _state.view(process_set, "allreduce")
    op = handle_average_backwards_compatibility(op, average)
    if op is Adasum:
        return _adasum_handle([tensor], [_state.op_name("allreduce", name, ps)], False,
                              prescale_factor, postscale_factor, lambda r: r[0], ps)
    h, plan = _allreduce_submit(tensor, None, _state.op_name("allreduce", name, ps), op,
                                prescale_factor, postscale_factor, ps)
    return TorchHandle([h], _reduce_finish(plan, None, ps))


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set) -> TorchHandle:
    """Reduce `tensor` over ranks in place."""
    ps = _state.view(process_set, "allreduce")
    op = handle_average_backwards_compatibility(op, average)
    if op is Adasum:
        return _adasum_handle([tensor], [_state.op_name("allreduce", name, ps)], True,
                              prescale_factor, postscale_factor, lambda r: r[0], ps)
    h, finish = _inplace_submit(tensor, name is not None, _state.op_name("allreduce", name, ps),
                                op, prescale_factor, postscale_factor, ps)
    return TorchHandle([h], lambda results: finish(results[0]))


def _inplace_submit(tensor, named: bool, full: str, op, pre, post, ps=None):
    """One in-place allreduce: queued in the engine's lane where that applies (a named op
    on the global set, `_lane`), else submitted to the engine.  Returns (handle,
    finish(its result) -> the result tensor)."""
    lane = _lane.allreduce_async_(tensor, full if named else None, op, pre, post) \
        if ps is None else None
    if lane is not None and lane[0] is not None:
        return lane[0], _same
    h, plan = _allreduce_submit(tensor, tensor, full, op, pre, post, ps)
    if lane is not None and plan is None:  # the first run of a name: arm its lane slot after
        arm = lane[1]
        return h, lambda result: (arm(h), result)[1]
    finish = _reduce_finish(plan, tensor, ps)
    return h, lambda result: finish([result])


def _same(result):
    return result


def _adasum_handle(tensors, names, inplace: bool, pre, post, result, ps=None) -> TorchHandle:
    handles, finish = _adasum.submit(tensors, names, inplace, pre, post, ps)
    return TorchHandle(handles, lambda r: result(finish(r)))


def _grouped(tensors: Sequence[torch.Tensor], inplace: bool, name, op, pre, post,
             ps=None) -> TorchHandle:
    base = _state.op_name("grouped_allreduce", name, ps)
    if op is Adasum:
        return _adasum_handle(list(tensors), [f"{base}.{i}" for i in range(len(tensors))],
                              inplace, pre, post, list, ps)
    handles, finishes = [], []
    for i, t in enumerate(tensors):
        full = f"{base}.{i}"
        if ps is None and name is not None and _lane.applies_async(t, full, op, pre, post):
            # in place on a copy where the caller keeps its tensor: the lane's path
            h, fin = _inplace_submit(t if inplace else t.clone(), True, full, op, pre, post)
        else:
            h, plan = _allreduce_submit(t, t if inplace else None, full, op, pre, post, ps)
            fin = _reduce_finish(plan, t if inplace else None, ps)
            fin = (lambda f: lambda result: f([result]))(fin)
        handles.append(h)
        finishes.append(fin)

    def finish(results):
        out = [f(r) for f, r in zip(finishes, results)]
        return list(tensors) if inplace else out
    return TorchHandle(handles, finish)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set) -> TorchHandle:
    """Reduce a list of tensors as one group; synchronize returns a list."""
    ps = _state.view(process_set, "grouped_allreduce")
    op = handle_average_backwards_compatibility(op, average)
    return _grouped(tensors, False, name, op, prescale_factor, postscale_factor, ps)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> TorchHandle:
    ps = _state.view(process_set, "grouped_allreduce")
    op = handle_average_backwards_compatibility(op, average)
    return _grouped(tensors, True, name, op, prescale_factor, postscale_factor, ps)


def allgather_async(tensor, name=None, process_set=global_process_set) -> TorchHandle:
    """Concatenate every rank's tensor along dim 0 (first dimensions may differ)."""
    ps = _state.view(process_set, "allgather")
    h = _state.submit(_state.op_name("allgather", name, ps), "allgather", tensor,
                      strict_join=True, view=ps)
    return TorchHandle([h], lambda r: r[0])


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> TorchHandle:
    """root_rank's tensor on every rank, in a new tensor (root_rank: a world rank)."""
    ps = _state.view(process_set, "broadcast")
    h = _state.submit(_state.op_name("broadcast", name, ps), "broadcast", tensor,
                      root=_root(ps, root_rank, "broadcast"), strict_join=True, view=ps)
    return TorchHandle([h], lambda r: r[0])


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> TorchHandle:
    """root_rank's tensor on every rank, written in place."""
    ps = _state.view(process_set, "broadcast")
    h = _state.submit(_state.op_name("broadcast", name, ps), "broadcast", tensor,
                      out=tensor, root=_root(ps, root_rank, "broadcast"), strict_join=True,
                      view=ps)
    return TorchHandle([h], lambda r: tensor)


def _splits_list(splits) -> Optional[List[int]]:
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        splits = splits.cpu().tolist()
    return [int(s) for s in splits]


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> TorchHandle:
    """Rows splits[j] go to rank j (of the set); synchronize returns (output, received_splits)."""
    ps = _state.view(process_set, "alltoall")
    h = _state.submit(_state.op_name("alltoall", name, ps), "alltoall", tensor,
                      splits=_splits_list(splits), view=ps)

    def finish(results):
        out, recv = results[0]
        return out, torch.from_numpy(np.asarray(recv, dtype=np.int32))
    return TorchHandle([h], finish)


def _not_adasum(op, what: str):
    if op is Adasum:
        raise InvalidArgument(f"{what}: Adasum applies to allreduce only; use Average or Sum")
    return op


def _root(ps, root_rank, what: str) -> int:
    """A root given as a world rank, as the set numbers it."""
    if ps is None:
        return root_rank
    try:
        return ps.root(root_rank, what)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def _check_scatterable(tensor, what: str) -> None:
    if tensor.dim() == 0:
        raise InvalidArgument(f"{what}: a 0-d tensor has no rows to scatter; pass a tensor "
                              f"of at least one dimension (on rank {_state.rank()}/{_state.size()})")


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0) -> TorchHandle:
    """Reduce over ranks, keep this rank's rows of dim 0 (the first ranks get one extra)."""
    ps = _state.view(process_set, "reducescatter")
    op = _not_adasum(handle_average_backwards_compatibility(op, None), "reducescatter")
    _check_scatterable(tensor, "reducescatter")
    h, plan = _reduce_submit("reducescatter", tensor, None,
                             _state.op_name("reducescatter", name, ps), op, prescale_factor,
                             postscale_factor, ps)
    return TorchHandle([h], _reduce_finish(plan, None, ps))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> TorchHandle:
    """allgather of each tensor, submitted together; synchronize returns a list."""
    ps = _state.view(process_set, "grouped_allgather")
    base = _state.op_name("grouped_allgather", name, ps)
    return TorchHandle([_state.submit(f"{base}.{i}", "allgather", t, strict_join=True, view=ps)
                        for i, t in enumerate(tensors)], list)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> TorchHandle:
    """reducescatter of each tensor, submitted together; synchronize returns a list."""
    ps = _state.view(process_set, "grouped_reducescatter")
    op = _not_adasum(handle_average_backwards_compatibility(op, None), "grouped_reducescatter")
    base = _state.op_name("grouped_reducescatter", name, ps)
    for i, t in enumerate(tensors):  # before any is submitted, so none is left pending
        _check_scatterable(t, f"grouped_reducescatter '{base}' tensor {i}")
    handles, plans = [], []
    for i, t in enumerate(tensors):
        h, plan = _reduce_submit("reducescatter", t, None, f"{base}.{i}", op, prescale_factor,
                                 postscale_factor, ps)
        handles.append(h)
        plans.append(plan)

    def finish(results):
        n = _state.set_size(ps)
        return [r if p is None else p.finish(r, n) for r, p in zip(results, plans)]
    return TorchHandle(handles, finish)


def sparse_allreduce_async(tensor, name=None, op=Average,
                           process_set=global_process_set) -> TorchHandle:
    """A sparse COO tensor reduced over ranks by allgathering its indices and values (an
    index several ranks hold appears once per rank; coalescing sums them)."""
    ps = _state.view(process_set, "sparse_allreduce")
    op = handle_average_backwards_compatibility(op, None)
    if op not in (Average, Sum):
        raise InvalidArgument(f"sparse_allreduce: only Average and Sum reduce sparse tensors, "
                              f"got {op.name.lower()}")
    t = tensor.coalesce()
    base = _state.op_name("sparse_allreduce", name, ps)
    handles = [_state.submit(f"{base}.indices", "allgather", t.indices().t().contiguous(),
                             view=ps),
               _state.submit(f"{base}.values", "allgather", t.values().contiguous(), view=ps)]

    def finish(results):
        indices, values = results
        if op == Average:
            values = values / _state.set_size(ps)
        return torch.sparse_coo_tensor(indices.t(), values, t.shape)
    return TorchHandle(handles, finish)


def add_process_set(process_set) -> ProcessSet:
    """Register a process set (a ProcessSet or a list of world ranks) on every rank, in the
    same order; needs dynamic process sets (HOROVOD_DYNAMIC_PROCESS_SETS=1 or
    hvd.init(process_sets="dynamic")).  Returns the registered ProcessSet."""
    return _state.add_process_set(process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set on every rank and free what its members held; False for
    the global set or a set not registered."""
    return _state.remove_process_set(process_set)


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
    """Return once every rank (of the process set) has called barrier()."""
    ps = _state.view(process_set, "barrier")
    with _state.waiting_now():
        handle = _state.submit(_state.op_name("barrier", None, ps), "barrier", view=ps)
    handle.wait()
