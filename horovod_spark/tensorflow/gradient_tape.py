"""DistributedGradientTape: a tf.GradientTape whose gradient() allreduces.

Wrap a tape after recording: `tape = hvd.DistributedGradientTape(tape)`.  The
wrapper is an instance of a subclass made on the fly from the tape's own class,
holding the recorded tape's state, so `gradient` computes the local gradients
exactly as the original would and then reduces them over ranks -- eagerly or
inside a tf.function.
"""
from __future__ import annotations

import tensorflow as tf

from ._gradients import GradientReducer
from .compression import Compression
from .mpi_ops import Average

__all__ = ["DistributedGradientTape"]


class _DistributedMixin:
    _hvd_reducer: GradientReducer

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        grads = super().gradient(target, sources, output_gradients, **kwargs)
        flat_src = tf.nest.flatten(sources)
        flat = self._hvd_reducer.reduce(tf.nest.flatten(grads), flat_src)
        return tf.nest.pack_sequence_as(grads, flat)


_classes: dict = {}


def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "",
                            device_sparse: str = "", compression=Compression.none,
                            sparse_as_dense: bool = False, op=Average,
                            gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                            groups=None) -> tf.GradientTape:
    """A tape that averages (op) its gradients over every rank.

    Args:
        gradtape: the tape that recorded the forward pass.
        compression: Compression.none or Compression.fp16.
        sparse_as_dense: densify tf.IndexedSlices instead of allgathering them.
        op: Average or Sum.
        gradient_predivide_factor: divide by this before the sum and by size/this after.
        num_groups, groups: split the fused gradient allreduce into several (Horovod's rules).
    """
    if not isinstance(gradtape, tf.GradientTape):
        raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape, got {type(gradtape).__name__}")
    base = type(gradtape)
    cls = _classes.get(base)
    if cls is None:
        cls = _classes[base] = type(base.__name__, (_DistributedMixin, base), {})
    tape = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)
    tape._hvd_reducer = GradientReducer("DistributedGradientTape", compression, sparse_as_dense,
                                        op, gradient_predivide_factor, num_groups, groups)
    return tape
