"""SyncBatchNormalization: Keras batch normalization over every rank's batch.

In training, the per-channel sums of x and x*x and the element count travel in
one Sum allreduce, so every rank normalizes with the global mean and (biased)
variance; the allreduce's gradient (an allreduce of the gradient) carries the
global terms back.  Masked inputs, and a world of one, use Keras's own moments.
"""
from __future__ import annotations

import keras
import tensorflow as tf

from . import _basics
from .mpi_ops import Sum, allreduce

__all__ = ["SyncBatchNormalization"]


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """keras.layers.BatchNormalization whose training moments cover every rank's batch.

    `fused` is Horovod's argument: False (the default) is accepted, True or None refused
    as Horovod refuses them (a fused kernel computes its own moments); Keras 3 has no
    such argument, so it goes no further."""

    def __init__(self, fused=False, **kwargs):
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        super().__init__(**kwargs)

    def _moments(self, inputs, mask):
        if mask is not None or _basics.size() == 1:
            return super()._moments(inputs, mask)
        x = tf.convert_to_tensor(inputs)
        axes = list(self._reduction_axes)
        total = tf.reduce_sum(x, axis=axes)
        squares = tf.reduce_sum(tf.square(x), axis=axes)
        count = tf.cast(tf.size(x) // tf.size(total), x.dtype)
        summed = allreduce(tf.concat([total, squares, tf.reshape(count, [1])], 0), op=Sum)
        c = tf.shape(total)[0]
        n = summed[2 * c]
        mean = summed[:c] / n
        return mean, tf.maximum(summed[c:2 * c] / n - tf.square(mean), 0.0)
