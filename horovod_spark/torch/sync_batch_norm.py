"""SyncBatchNorm: batch normalization over the batch of every rank together.

Training forward: each rank sums its values and squares per channel; one
allreduce gives the global count, mean and (biased) variance, with which every
rank normalizes its own rows.  Backward: one allreduce of the per-channel sums
of dy and dy * x_hat gives the global terms of the input gradient; the weight
and bias gradients stay local (the DistributedOptimizer averages them, as it
does every parameter's).  Ranks may hold batches of different sizes.  In eval
mode, or in a world of one, it is a plain BatchNorm.
"""
from __future__ import annotations

import torch

from . import _state
from . import mpi_ops as M

__all__ = ["SyncBatchNorm"]


def _reduce_dims(x: torch.Tensor) -> list:
    return [0] + list(range(2, x.dim()))


def _per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return v.view([1, -1] + [1] * (x.dim() - 2))


def _allreduce_sum(t: torch.Tensor) -> torch.Tensor:
    return M.synchronize(M.allreduce_async(t, op=M.Sum, name=None))


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum):
        dims, c = _reduce_dims(x), x.shape[1]
        xd = x.double()
        local = torch.cat([xd.sum(dims), (xd * xd).sum(dims),
                           torch.tensor([x.numel() / c], dtype=torch.float64)])
        total = _allreduce_sum(local)
        count = total[-1]
        mean = total[:c] / count
        var = (total[c:2 * c] / count - mean * mean).clamp_min(0)
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            unbiased = var * count / (count - 1) if count > 1 else var
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        xhat = ((xd - _per_channel(mean, x)) * _per_channel(invstd, x)).to(x.dtype)
        ctx.save_for_backward(xhat, weight, invstd.to(x.dtype), count)
        y = xhat
        if weight is not None:
            y = y * _per_channel(weight, x) + _per_channel(bias, x)
        return y

    @staticmethod
    def backward(ctx, dy):
        xhat, weight, invstd, count = ctx.saved_tensors
        dims, c = _reduce_dims(dy), dy.shape[1]
        sum_dy, sum_dy_xhat = dy.sum(dims), (dy * xhat).sum(dims)
        total = _allreduce_sum(torch.cat([sum_dy, sum_dy_xhat]).double())
        mean_dy = (total[:c] / count).to(dy.dtype)
        mean_dy_xhat = (total[c:] / count).to(dy.dtype)
        scale = invstd if weight is None else invstd * weight
        dx = (dy - _per_channel(mean_dy, dy) - xhat * _per_channel(mean_dy_xhat, dy)) \
            * _per_channel(scale, dy)
        dw = sum_dy_xhat if weight is not None else None
        db = sum_dy if weight is not None else None
        return dx, dw, db, None, None, None, None


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """BatchNorm whose training statistics cover every rank's batch (input: N, C, ...)."""

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects at least 2-d input (N, C, ...), got {x.dim()}-d")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if not self.training or _state.size() == 1:
            return super().forward(x)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative moving average, as BatchNorm's
                factor = 1.0 / float(self.num_batches_tracked)
        track = self.track_running_stats and self.running_mean is not None
        return _SyncBatchNorm.apply(x, self.weight, self.bias,
                                    self.running_mean if track else None,
                                    self.running_var if track else None, self.eps, factor)
