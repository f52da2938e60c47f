"""DistributedGradientTape: a tf.GradientTape whose gradient() allreduces.

Wrap a tape after recording: `tape = hvd.DistributedGradientTape(tape)`.  The
wrapper is an instance of a subclass made on the fly from the tape's own class,
holding the recorded tape's state, so `gradient` computes the local gradients
exactly as the original would and then reduces them over ranks -- eagerly or
inside a tf.function.
"""
from __future__ import annotations

import tensorflow as tf

from .gradients import GradientReducer
from .compression import Compression
from .mpi_ops import Average

__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape"]


class _DistributedMixin:
    _hvd_reducer: GradientReducer

    def register_local_source(self, source) -> None:
        """Keep `source`'s gradient on this rank: not reduced (scaled by 1/size by default)."""
        self._hvd_reducer.register_local(source)

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
                            groups=None, scale_local_gradients: bool = True,
                            process_set=None) -> tf.GradientTape:
    """A tape that averages (op) its gradients over every rank (of `process_set`).

    Args:
        gradtape: the tape that recorded the forward pass.
        compression: Compression.none or Compression.fp16.
        sparse_as_dense: densify tf.IndexedSlices instead of allgathering them.
        op: Average, Sum or Adasum (the gradients combined by the Adasum tree, as
            Horovod's tape and Keras optimizer do; a power-of-two world).
        gradient_predivide_factor: divide by this before the sum and by size/this after.
        num_groups, groups: split the fused gradient allreduce into several (Horovod's rules).
        scale_local_gradients: divide the gradients of local sources by the world size.
        process_set: the ranks that average (every rank by default).
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
                                        op, gradient_predivide_factor, num_groups, groups,
                                        process_set)
    tape._hvd_reducer.scale_local = bool(scale_local_gradients)
    return tape


def local_variables_of(local_layers) -> list:
    """The trainable variables of a layer or a collection of layers (Horovod's local_layers)."""
    import keras

    if local_layers is None:
        return []
    if isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    local_layers = list(local_layers)
    bad = [type(x).__name__ for x in local_layers if not isinstance(x, keras.layers.Layer)]
    if bad:
        raise ValueError(f"local_layers takes Keras layers, got {', '.join(bad)}")
    return [v for layer in local_layers for v in layer.trainable_weights]


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "",
                                   device_sparse: str = "", compression=Compression.none,
                                   sparse_as_dense: bool = False, op=Average,
                                   gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                                   groups=None, local_layers=None,
                                   scale_local_gradients: bool = True,
                                   process_set=None) -> tf.GradientTape:
    """DistributedGradientTape whose `local_layers`' gradients stay on each rank."""
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, scale_local_gradients, process_set)
    for v in local_variables_of(local_layers):
        tape.register_local_source(v)
    return tape
