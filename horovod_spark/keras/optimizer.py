"""DistributedOptimizer for Keras 3 optimizers.

Keras 3 funnels every update -- `model.fit`'s train step, `apply_gradients`
and `apply` -- through `Optimizer.apply(grads, variables)`.  The wrapper is an
instance of a subclass made on the fly from the optimizer's own class, with
`apply` overridden to reduce the gradients over ranks first (fused, through
the same kernels as every other op) and `build` extended for local gradient
aggregation.  The subclass keeps the base class's name and module, so a saved
model records a plain Keras optimizer and loads without horovod_spark.

Mixed precision: under the mixed_float16 policy Keras wraps the optimizer in
a LossScaleOptimizer at compile time, and that wrapper applies the inner
optimizer only when the *local* gradients are finite -- one rank overflowing
would skip the reduction the others wait in.  So the wrapper is made here,
outside: the gradients are reduced first and every rank sees the same
overflow and takes the same branch.
"""
from __future__ import annotations

from typing import Optional

from ..tensorflow.gradients import GradientReducer
from ..tensorflow.compression import Compression
from ..tensorflow.mpi_ops import Adasum, Average
from ._aggregation import LocalAggregator

__all__ = ["DistributedOptimizer", "PartialDistributedOptimizer", "make_distributed"]


class _HvdState:
    """Plain holder (not tracked by Keras, so not saved with the optimizer)."""

    def __init__(self, reducer: GradientReducer, aggregator: Optional[LocalAggregator]) -> None:
        self.reducer = reducer
        self.aggregator = aggregator


class _DistributedOptimizer:
    _hvd: _HvdState

    def build(self, variables):
        super().build(variables)
        if self._hvd.aggregator is not None:
            self._hvd.aggregator.build(variables)

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        variables = (list(trainable_variables) if trainable_variables is not None
                     else getattr(self, "_trainable_variables", None))
        base_apply = super(_DistributedOptimizer, self).apply
        hv = self._hvd
        if hv.aggregator is None:
            return base_apply(hv.reducer.reduce(grads, variables), trainable_variables)
        if not self.built:
            self.build(variables)
            self.built = True

        def apply_reduced(summed):
            base_apply(hv.reducer.reduce(summed, variables), variables)

        return hv.aggregator.step(grads, variables, apply_reduced, self._iterations)


_classes: dict = {}


def _distributed_class(base: type) -> type:
    if issubclass(base, _DistributedOptimizer):
        return base
    cls = _classes.get(base)
    if cls is None:
        cls = type(base.__name__, (_DistributedOptimizer, base),
                   {"__module__": base.__module__, "__qualname__": base.__qualname__})
        _classes[base] = cls
    return cls


def make_distributed(optimizer, compression=Compression.none, sparse_as_dense: bool = False,
                     backward_passes_per_step: int = 1, op=Average,
                     gradient_predivide_factor: float = 1.0,
                     average_aggregated_gradients: bool = False, num_groups: int = 0,
                     groups=None, process_set=None):
    """Turn `optimizer` itself into a distributed one, keeping its state (for load_model)."""
    reducer = GradientReducer("DistributedOptimizer", compression, sparse_as_dense, op,
                              gradient_predivide_factor, num_groups, groups, process_set)
    if reducer.op is Adasum and average_aggregated_gradients:
        raise ValueError("DistributedOptimizer: Adasum does not average aggregated gradients; "
                         "pass average_aggregated_gradients=False")
    aggregator = (LocalAggregator(backward_passes_per_step, average_aggregated_gradients)
                  if backward_passes_per_step != 1 else None)
    optimizer.__class__ = _distributed_class(type(optimizer))
    optimizer._hvd = _HvdState(reducer, aggregator)
    if aggregator is not None and optimizer.built:
        aggregator.build(optimizer._trainable_variables)
    return optimizer


def DistributedOptimizer(optimizer, name: Optional[str] = None, device_dense: str = "",
                         device_sparse: str = "", compression=Compression.none,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op=Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups=None, process_set=None):
    """A new optimizer, configured like `optimizer`, that averages gradients over ranks.

    Args:
        optimizer: a Keras 3 optimizer (keras.optimizers.*).
        name: the new optimizer's name (default: the original's).
        compression: Compression.none or Compression.fp16.
        sparse_as_dense: densify tf.IndexedSlices gradients instead of allgathering them.
        op: Average, Sum or Adasum (the gradients combined by the Adasum tree, as
            Horovod's tape and Keras optimizer do; a power-of-two world).
        backward_passes_per_step: sum this many passes locally before one reduction.
        average_aggregated_gradients: divide the local sum by backward_passes_per_step.
        gradient_predivide_factor, num_groups, groups: as in Horovod.
        process_set: the ranks that average (every rank by default); only its members
            train with this optimizer.
    """
    import keras

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a Keras 3 optimizer, got {type(optimizer).__name__}")
    if (keras.config.dtype_policy().name == "mixed_float16"
            and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer)):
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    fresh = type(optimizer).from_config(config)
    return make_distributed(fresh, compression, sparse_as_dense, backward_passes_per_step, op,
                            gradient_predivide_factor, average_aggregated_gradients, num_groups,
                            groups, process_set)


def PartialDistributedOptimizer(optimizer, name: Optional[str] = None, device_dense: str = "",
                                device_sparse: str = "", compression=Compression.none,
                                sparse_as_dense: bool = False,
                                gradient_predivide_factor: float = 1.0, op=Average,
                                backward_passes_per_step: int = 1,
                                average_aggregated_gradients: bool = False, groups=None,
                                local_layers=None, scale_local_gradients: bool = True,
                                process_set=None):
    """DistributedOptimizer whose `local_layers`' gradients stay on each rank (divided by
    the world size unless scale_local_gradients=False), as Horovod's."""
    from ..tensorflow.gradient_tape import local_variables_of

    local = local_variables_of(local_layers)
    opt = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression,
                               sparse_as_dense, gradient_predivide_factor, op,
                               backward_passes_per_step, average_aggregated_gradients,
                               groups=groups, process_set=process_set)
    for v in local:
        opt._hvd.reducer.register_local(v)
    opt._hvd.reducer.scale_local = bool(scale_local_gradients)
    return opt
