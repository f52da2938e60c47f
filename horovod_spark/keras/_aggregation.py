"""Local gradient aggregation for `backward_passes_per_step` N > 1.

Each backward pass adds its gradients to one *accumulator* per variable and
counts the pass; the Nth pass reduces the accumulated sums over ranks (divided
by N first with `average_aggregated_gradients`), applies them, and clears the
accumulators.  The other passes only advance the optimizer's iteration count,
as Keras's own gradient accumulation and Horovod do.  The accumulators are
plain tf.Variables outside the optimizer's tracked state, so a saved model
loads into a plain Keras optimizer.  In a tf.function the choice between the
two paths is a tf.cond; every rank runs the same number of passes, so every
rank takes the reducing branch on the same pass.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import tensorflow as tf

__all__ = ["LocalAggregator"]


class LocalAggregator:
    def __init__(self, passes: int, average: bool) -> None:
        if not isinstance(passes, int) or passes < 1:
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {passes!r}")
        self.passes = passes
        self.average = bool(average)
        self.counter: Optional[tf.Variable] = None
        self.accumulators: list = []

    def build(self, variables: Sequence) -> None:
        if self.counter is not None:
            return
        with tf.init_scope():  # eager variables, even when first called in a tf.function
            self.counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="hvd_passes")
            self.accumulators = [tf.Variable(tf.zeros(v.shape, dtype=v.dtype), trainable=False,
                                             name="hvd_accumulator") for v in variables]

    def _accumulate(self, grads: Sequence) -> None:
        for g, acc in zip(grads, self.accumulators):
            if g is not None:
                acc.assign_add(tf.cast(tf.convert_to_tensor(g), acc.dtype))

    def _summed(self, grads: Sequence) -> list:
        scale = 1.0 / self.passes if self.average else 1.0
        return [None if g is None else (acc.read_value() * scale if scale != 1.0 else acc.read_value())
                for g, acc in zip(grads, self.accumulators)]

    def step(self, grads: Sequence, variables: Sequence, apply: Callable[[list], None],
             iterations: tf.Variable):
        """Accumulate one pass; on every Nth pass, apply(summed gradients)."""
        self.build(variables)
        if len(grads) != len(self.accumulators):
            raise ValueError(f"backward_passes_per_step: got {len(grads)} gradients for "
                             f"{len(self.accumulators)} variables seen at the first step")
        self._accumulate(grads)
        count = self.counter.assign_add(1)

        def flush():
            apply(self._summed(grads))
            for acc in self.accumulators:
                acc.assign(tf.zeros_like(acc))
            self.counter.assign(0)
            return tf.constant(True)

        def skip():
            iterations.assign_add(1)
            return tf.constant(False)

        if tf.executing_eagerly():
            return flush() if int(count) >= self.passes else skip()
        return tf.cond(count >= self.passes, flush, skip)
