"""The torch training step's parts: gradients as views of flat buffers, averaged
with one allreduce per step, and per-batch values summed on their device."""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

import numpy as np

__all__ = ["Gradients", "Sums", "FLUSH"]


class Gradients:
    """The optimizer's gradients as views of flat buffers, one per (dtype, device):
    autograd accumulates into them in place, and a step averages them over the
    ranks with one allreduce (a grouped one for several buffers), compressed on
    the way when a ``compression`` (``hvd.Compression.fp16``) is given."""

    NAME = "estimator.gradients"

    def __init__(self, optimizer, hvd, compression: Any = None):
        from horovod_spark.torch.buckets import Bucket

        self.optimizer, self.hvd, self.reduce = optimizer, hvd, hvd.size() > 1
        self.compression = None if compression is hvd.Compression.none else compression
        self.steps = 0  # optimizer steps taken
        params = [p for group in optimizer.param_groups for p in group["params"]]
        params = [p for p in dict.fromkeys(params) if p.requires_grad]
        by_kind: Dict[tuple, list] = {}
        for p in params:
            by_kind.setdefault((p.dtype, p.device), []).append(p)
        self.buckets = [Bucket(f"{self.NAME}.{i}", members)
                        for i, members in enumerate(by_kind.values())]
        self.buffers = [b.flat for b in self.buckets]
        self.attach()

    def attach(self) -> None:
        """Point every ``.grad`` at its view (once per epoch: nothing in a step replaces one)."""
        for bucket in self.buckets:
            for p in bucket.members:
                bucket.attach(p)

    def step(self) -> None:
        """Average the gradients over the ranks, step the optimizer, clear the gradients."""
        if self.reduce and self.compression is not None:
            self._reduce_compressed()
        elif self.reduce:
            if len(self.buffers) == 1:
                self.hvd.allreduce_(self.buffers[0], op=self.hvd.Average, name=self.NAME)
            elif self.buffers:
                self.hvd.grouped_allreduce_(self.buffers, op=self.hvd.Average, name=self.NAME)
        self.optimizer.step()
        self.steps += 1
        for flat in self.buffers:
            flat.zero_()

    def _reduce_compressed(self) -> None:
        reduced = self.hvd.grouped_allreduce(self.buffers, op=self.hvd.Average,
                                             compression=self.compression, name=self.NAME)
        for flat, out in zip(self.buffers, reduced):
            flat.copy_(out)


class HookOptimizer:
    """The optimizer a ``train_minibatch_fn`` gets: ``step()`` averages the gradients
    over the ranks before stepping (on every ``backward_passes_per_step``-th call: the
    hook's loss is not divided by that count), ``zero_grad()`` leaves the gradient views
    in place (the step clears them); anything else is the user's optimizer's."""

    def __init__(self, grads: Gradients, k: int):
        self._grads, self._k, self._calls = grads, k, 0

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("the estimator's optimizer takes no closure in step(); compute "
                             "the loss and call backward() in train_minibatch_fn")
        self._calls += 1
        if self._calls % self._k == 0:
            self._grads.attach()  # a gradient the hook replaced (set_to_none) is copied in
            self._grads.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the gradients are zero after every step."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grads.optimizer, name)


FLUSH = 256  # steps whose values Sums keeps as tensors before it adds them up


class Sums:
    """Row-weighted sums of per-batch values (the loss, each metric), added up on
    their device every FLUSH batches, so the host reads them once per epoch."""

    def __init__(self, width: int):
        self.values: List[list] = [[] for _ in range(width)]
        self.weights: List[int] = []
        self.totals: List[Any] = [0.0] * width
        self.rows = 0

    def add(self, values: Sequence[Any], rows: int) -> None:
        for column, value in zip(self.values, values):
            column.append(value)
        self.weights.append(rows)
        if len(self.weights) >= FLUSH:
            self._flush()

    def _flush(self) -> None:
        import torch

        rows, self.weights = self.weights, []
        if not rows:
            return
        for j, column in enumerate(self.values):
            if all(isinstance(v, torch.Tensor) for v in column):
                stacked = torch.stack([v.reshape(()) for v in column]).double()
                weights = torch.tensor(rows, dtype=torch.float64, device=stacked.device)
                self.totals[j] = self.totals[j] + (stacked * weights).sum()
            else:
                self.totals[j] = self.totals[j] + sum(float(v) * n for v, n in zip(column, rows))
            column.clear()
        self.rows += sum(rows)

    def result(self) -> np.ndarray:
        """[sum of value * rows for each value ..., rows]."""
        self._flush()
        return np.array([float(t) for t in self.totals] + [self.rows], dtype=np.float64)
