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

from . import _state
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


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, pre, post):
        ctx.args = (op, pre, post)
        return _now(lambda: M.allreduce_async(tensor, name=name, op=op, prescale_factor=pre,
                                               postscale_factor=post))

    @staticmethod
    def backward(ctx, grad):
        op, pre, post = ctx.args
        return allreduce(grad, op=op, prescale_factor=pre, postscale_factor=post), None, None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=M.global_process_set):
    """A new tensor: `tensor` reduced over every rank (Average unless op says otherwise)."""
    M._check_process_set(process_set)
    op = M.handle_average_backwards_compatibility(op, average)
    compressed, cctx = compression.compress(tensor)
    reduced = _Allreduce.apply(compressed, name, op, prescale_factor, postscale_factor)
    return compression.decompress(reduced, cctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=M.global_process_set):
    """Reduce `tensor` over every rank in place; returns it."""
    return _now(lambda: M.allreduce_async_(tensor, average, name, op, prescale_factor,
                                            postscale_factor, process_set))


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, pre, post, *tensors):
        ctx.args = (op, pre, post)
        return tuple(_now(lambda: M.grouped_allreduce_async(
            list(tensors), name=name, op=op, prescale_factor=pre, postscale_factor=post)))

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post = ctx.args
        out = grouped_allreduce(list(grads), op=op, prescale_factor=pre, postscale_factor=post)
        return (None, None, None, None, *out)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=M.global_process_set):
    """New tensors: each of `tensors` reduced over every rank, submitted as one group."""
    M._check_process_set(process_set)
    op = M.handle_average_backwards_compatibility(op, average)
    pairs = [compression.compress(t) for t in tensors]
    reduced = _GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor,
                                      *[c for c, _ in pairs])
    return [compression.decompress(r, cctx) for r, (_, cctx) in zip(reduced, pairs)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=M.global_process_set):
    return _now(lambda: M.grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                    postscale_factor, process_set))


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name):
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        return _now(lambda: M.allgather_async(tensor, name=name))

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, op=M.Average)
        rows = _now(lambda: M.allgather_async(torch.tensor([ctx.rows], dtype=torch.int64)))
        offset = int(rows[:_state.rank()].sum())
        return reduced.narrow(0, offset, ctx.rows), None


def allgather(tensor, name=None, process_set=M.global_process_set):
    """Every rank's tensor concatenated along dim 0; first dimensions may differ."""
    M._check_process_set(process_set)
    return _Allgather.apply(tensor, name)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root, name):
        ctx.root = root
        return _now(lambda: M.broadcast_async(tensor, root, name=name))

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, op=M.Average)
        if _state.rank() != ctx.root:
            reduced = reduced * 0
        return reduced, None, None


def broadcast(tensor, root_rank, name=None, process_set=M.global_process_set):
    """A new tensor holding root_rank's `tensor`."""
    M._check_process_set(process_set)
    return _Broadcast.apply(tensor, root_rank, name)


def broadcast_(tensor, root_rank, name=None, process_set=M.global_process_set):
    """Overwrite `tensor` with root_rank's; returns it."""
    return _now(lambda: M.broadcast_async_(tensor, root_rank, name, process_set))


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name):
        out, recv = _now(lambda: M.alltoall_async(tensor, splits, name=name))
        ctx.recv = recv
        ctx.mark_non_differentiable(recv)
        return out, recv

    @staticmethod
    def backward(ctx, grad, _recv_grad):
        back, _ = alltoall(grad.contiguous(), splits=ctx.recv)
        return back, None, None


def alltoall(tensor, splits=None, name=None, process_set=M.global_process_set):
    """Rows splits[j] of `tensor` go to rank j.

    Returns the received rows, and with `splits` also the received splits (int32).
    """
    M._check_process_set(process_set)
    out, recv = _Alltoall.apply(tensor, splits, name)
    return out if splits is None else (out, recv)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, pre, post):
        ctx.scale = pre * post * (_state.size() if op == M.Sum else 1)
        return _now(lambda: M.reducescatter_async(tensor, name=name, op=op, prescale_factor=pre,
                                                   postscale_factor=post))

    @staticmethod
    def backward(ctx, grad):
        gathered = _now(lambda: M.allgather_async(grad.contiguous()))
        return gathered * ctx.scale, None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=M.Average,
                  process_set=M.global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce over every rank, keep this rank's rows of dim 0 (the first ranks get one extra)."""
    M._check_process_set(process_set)
    op = M.handle_average_backwards_compatibility(op, None)
    compressed, cctx = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, name, op, prescale_factor, postscale_factor)
    return compression.decompress(out, cctx)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, *tensors):
        ctx.rows = [t.shape[0] if t.dim() else 1 for t in tensors]
        return tuple(_now(lambda: M.grouped_allgather_async(list(tensors), name=name)))

    @staticmethod
    def backward(ctx, *grads):
        reduced = grouped_allreduce(list(grads), op=M.Average)
        rows = _now(lambda: M.allgather_async(torch.tensor([ctx.rows], dtype=torch.int64)))
        offsets = rows[:_state.rank()].sum(0).tolist()
        return (None, *[g.narrow(0, off, n) for g, off, n in zip(reduced, offsets, ctx.rows)])


def grouped_allgather(tensors, name=None, process_set=M.global_process_set):
    """allgather of each tensor, as one group."""
    M._check_process_set(process_set)
    return list(_GroupedAllgather.apply(name, *tensors))


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, pre, post, *tensors):
        ctx.scale = pre * post * (_state.size() if op == M.Sum else 1)
        return tuple(_now(lambda: M.grouped_reducescatter_async(
            list(tensors), name=name, op=op, prescale_factor=pre, postscale_factor=post)))

    @staticmethod
    def backward(ctx, *grads):
        gathered = _now(lambda: M.grouped_allgather_async([g.contiguous() for g in grads]))
        return (None, None, None, None, *[g * ctx.scale for g in gathered])


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=M.Average,
                          process_set=M.global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    """reducescatter of each tensor, as one group."""
    M._check_process_set(process_set)
    op = M.handle_average_backwards_compatibility(op, None)
    pairs = [compression.compress(t) for t in tensors]
    out = _GroupedReducescatter.apply(name, op, prescale_factor, postscale_factor,
                                      *[c for c, _ in pairs])
    return [compression.decompress(o, cctx) for o, (_, cctx) in zip(out, pairs)]
