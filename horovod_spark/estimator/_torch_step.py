"""The torch training step's parts: gradients as views of flat buffers, averaged
with one allreduce per step, and per-batch values summed on their device."""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

import numpy as np

__all__ = ["Gradients", "Sums", "FLUSH"]


class Gradients:
    """The optimizer's gradients as views of flat buffers, one per (dtype, device):
    autograd accumulates into them in place, and a step averages them over the
    ranks with one allreduce (a grouped one for several buffers)."""

    NAME = "estimator.gradients"

    def __init__(self, optimizer, hvd):
        from horovod_spark.torch.buckets import Bucket

        self.optimizer, self.hvd, self.reduce = optimizer, hvd, hvd.size() > 1
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
        if self.reduce:
            if len(self.buffers) == 1:
                self.hvd.allreduce_(self.buffers[0], op=self.hvd.Average, name=self.NAME)
            elif self.buffers:
                self.hvd.grouped_allreduce_(self.buffers, op=self.hvd.Average, name=self.NAME)
        self.optimizer.step()
        for flat in self.buffers:
            flat.zero_()


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
