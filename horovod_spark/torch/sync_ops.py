"""The blocking ops of Horovod's torch API, differentiable where Horovod's are.

Each is its async twin plus `synchronize` (submitted lazily: the wait runs the
engine's cycle on the caller's thread), wrapped in an autograd Function
with Horovod's gradients: the gradient of an allreduce is the allreduce of
the gradient; of an allgather, the averaged gradient's own rows; of a
broadcast, the averaged gradient on the root and zeros elsewhere; of an
alltoall, the alltoall back; of a reducescatter, the allgather of the
gradient times the factors (and the world size for Sum: Horovod's convention,
under which Average's gradient is the gathered gradient itself).
"""
from __future__ import annotations

import torch

from . import _lane, _state
from . import mpi_ops as M
from .compression import Compression

__all__ = ["allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_", "allgather",
           "grouped_allgather", "broadcast", "broadcast_", "alltoall", "reducescatter",
           "grouped_reducescatter"]


def _now(start):
    """Submit (start()) and wait: the ops go lazily (see _state.waiting_now)."""
    with _state.waiting_now():
        handle = start()
    return M.synchronize(handle)


def _ps_rank(process_set) -> int:
    """This rank's place in the set (the world's rank for the global set)."""
    return _state.set_rank(_state.view(process_set, "gradient"))


def _ps_size(process_set) -> int:
    return _state.set_size(_state.view(process_set, "gradient"))


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, pre, post, ps):
        ctx.args = (op, pre, post, ps)
        out = _lane.allreduce(tensor, name, op, pre, post, inplace=False, process_set=ps)
        if out is not None:
            return out
        return _now(lambda: M.allreduce_async(tensor, name=name, op=op, prescale_factor=pre,
                                               postscale_factor=post, process_set=ps))

    @staticmethod
    def backward(ctx, grad):
        op, pre, post, ps = ctx.args
        return (allreduce(grad, op=op, prescale_factor=pre, postscale_factor=post,
                          process_set=ps), None, None, None, None, None)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=M.global_process_set):
    """A new tensor: `tensor` reduced over every rank of the process set (Average unless op
    says otherwise)."""
    _state.view(process_set, "allreduce")
    op = M.handle_average_backwards_compatibility(op, average)
    compressed, cctx = compression.compress(tensor)
    reduced = _Allreduce.apply(compressed, name, op, prescale_factor, postscale_factor,
                               process_set)
    return compression.decompress(reduced, cctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=M.global_process_set):
    """Reduce `tensor` over every rank in place; returns it."""
    if _lane.allreduce(tensor, name, M.handle_average_backwards_compatibility(op, average),
                       prescale_factor, postscale_factor, inplace=True, process_set=process_set) is not None:
        return tensor
    return _now(lambda: M.allreduce_async_(tensor, average, name, op, prescale_factor,
                                            postscale_factor, process_set))


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, pre, post, ps, *tensors):
        ctx.args = (op, pre, post, ps)
        return tuple(_now(lambda: M.grouped_allreduce_async(
            list(tensors), name=name, op=op, prescale_factor=pre, postscale_factor=post,
            process_set=ps)))

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, ps = ctx.args
        out = grouped_allreduce(list(grads), op=op, prescale_factor=pre, postscale_factor=post,
                                process_set=ps)
        return (None, None, None, None, None, *out)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=M.global_process_set):
    """New tensors: each of `tensors` reduced over every rank, submitted as one group."""
    _state.view(process_set, "grouped_allreduce")
    op = M.handle_average_backwards_compatibility(op, average)
    pairs = [compression.compress(t) for t in tensors]
    reduced = _GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor, process_set,
                                      *[c for c, _ in pairs])
    return [compression.decompress(r, cctx) for r, (_, cctx) in zip(reduced, pairs)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=M.global_process_set):
    return _now(lambda: M.grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                    postscale_factor, process_set))


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, ps):
        ctx.rows, ctx.ps = (tensor.shape[0] if tensor.dim() else 1), ps
        return _now(lambda: M.allgather_async(tensor, name=name, process_set=ps))

    @staticmethod
    def backward(ctx, grad):
        ps = ctx.ps
        reduced = allreduce(grad, op=M.Average, process_set=ps)
        rows = _now(lambda: M.allgather_async(torch.tensor([ctx.rows], dtype=torch.int64),
                                              process_set=ps))
        offset = int(rows[:_ps_rank(ps)].sum())
        return reduced.narrow(0, offset, ctx.rows), None, None


def allgather(tensor, name=None, process_set=M.global_process_set):
    """Every rank's tensor concatenated along dim 0; first dimensions may differ."""
    _state.view(process_set, "allgather")
    return _Allgather.apply(tensor, name, process_set)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root, name, ps):
        ctx.root, ctx.ps = root, ps
        return _now(lambda: M.broadcast_async(tensor, root, name=name, process_set=ps))

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, op=M.Average, process_set=ctx.ps)
        if _state.rank() != ctx.root:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=M.global_process_set):
    """A new tensor holding root_rank's `tensor` (root_rank: a world rank)."""
    _state.view(process_set, "broadcast")
    return _Broadcast.apply(tensor, root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=M.global_process_set):
    """Overwrite `tensor` with root_rank's; returns it."""
    return _now(lambda: M.broadcast_async_(tensor, root_rank, name, process_set))


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, ps):
        out, recv = _now(lambda: M.alltoall_async(tensor, splits, name=name, process_set=ps))
        ctx.recv, ctx.ps = recv, ps
        ctx.mark_non_differentiable(recv)
        return out, recv

    @staticmethod
    def backward(ctx, grad, _recv_grad):
        back, _ = alltoall(grad.contiguous(), splits=ctx.recv, process_set=ctx.ps)
        return back, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=M.global_process_set):
    """Rows splits[j] of `tensor` go to rank j.

    Returns the received rows, and with `splits` also the received splits (int32).
    """
    _state.view(process_set, "alltoall")
    out, recv = _Alltoall.apply(tensor, splits, name, process_set)
    return out if splits is None else (out, recv)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, pre, post, ps):
        ctx.scale = pre * post * (_ps_size(ps) if op == M.Sum else 1)
        ctx.ps = ps
        return _now(lambda: M.reducescatter_async(tensor, name=name, op=op, prescale_factor=pre,
                                                   postscale_factor=post, process_set=ps))

    @staticmethod
    def backward(ctx, grad):
        gathered = _now(lambda: M.allgather_async(grad.contiguous(), process_set=ctx.ps))
        return gathered * ctx.scale, None, None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=M.Average,
                  process_set=M.global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce over every rank, keep this rank's rows of dim 0 (the first ranks get one extra)."""
    _state.view(process_set, "reducescatter")
    op = M.handle_average_backwards_compatibility(op, None)
    compressed, cctx = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, name, op, prescale_factor, postscale_factor,
                               process_set)
    return compression.decompress(out, cctx)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, ps, *tensors):
        ctx.rows, ctx.ps = [t.shape[0] if t.dim() else 1 for t in tensors], ps
        return tuple(_now(lambda: M.grouped_allgather_async(list(tensors), name=name,
                                                            process_set=ps)))

    @staticmethod
    def backward(ctx, *grads):
        ps = ctx.ps
        reduced = grouped_allreduce(list(grads), op=M.Average, process_set=ps)
        rows = _now(lambda: M.allgather_async(torch.tensor([ctx.rows], dtype=torch.int64),
                                              process_set=ps))
        offsets = rows[:_ps_rank(ps)].sum(0).tolist()
        return (None, None, *[g.narrow(0, off, n) for g, off, n in zip(reduced, offsets, ctx.rows)])


def grouped_allgather(tensors, name=None, process_set=M.global_process_set):
    """allgather of each tensor, as one group."""
    _state.view(process_set, "grouped_allgather")
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, pre, post, ps, *tensors):
        ctx.scale = pre * post * (_ps_size(ps) if op == M.Sum else 1)
        ctx.ps = ps
        return tuple(_now(lambda: M.grouped_reducescatter_async(
            list(tensors), name=name, op=op, prescale_factor=pre, postscale_factor=post,
            process_set=ps)))

    @staticmethod
    def backward(ctx, *grads):
        gathered = _now(lambda: M.grouped_allgather_async([g.contiguous() for g in grads],
                                                          process_set=ctx.ps))
        return (None, None, None, None, None, *[g * ctx.scale for g in gathered])


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=M.Average,
                          process_set=M.global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    """reducescatter of each tensor, as one group."""
    _state.view(process_set, "grouped_reducescatter")
    op = M.handle_average_backwards_compatibility(op, None)
    pairs = [compression.compress(t) for t in tensors]
    out = _GroupedReducescatter.apply(name, op, prescale_factor, postscale_factor, process_set,
                                      *[c for c, _ in pairs])
    return [compression.decompress(o, cctx) for o, (_, cctx) in zip(out, pairs)]
