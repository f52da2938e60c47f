"""Horovod's TensorFlow API on horovod_spark: `import horovod_spark.tensorflow as hvd`.

    hvd.init()
    with tf.GradientTape() as tape:
        loss = ...
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)

Works on TensorFlow 2.16+ with Keras 3, eagerly and inside tf.function (not
inside XLA-compiled functions).  For Keras, see `horovod_spark.keras`.
"""
from __future__ import annotations

from ..common.exceptions import HorovodInternalError
from collectives.errors import (CollectiveError, CollectiveTimeout, MismatchError, NotSupported,
                                PeerLostError)

from ._errors import InvalidArgument
from ._basics import (cross_rank, cross_size, init, is_homogeneous, is_initialized, local_rank,
                      local_size, rank, shutdown, size, start_timeline, stop_timeline)
from ._compat import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled, mpi_built,
                      mpi_enabled, mpi_threads_supported, nccl_built, rocm_built)
from .compression import Compression
from . import elastic
from .functions import (allgather_object, broadcast_, broadcast_global_variables,
                        broadcast_object, broadcast_object_fn, broadcast_variables)
from .gradient_tape import DistributedGradientTape, PartialDistributedGradientTape
from .grouped_ops import grouped_allgather, grouped_reducescatter
from .sync_batch_norm import SyncBatchNormalization
from .mpi_ops import (Adasum, Average, Max, Min, Product, ProcessSet, Sum, add_process_set,
                      allgather, allreduce, alltoall, barrier, broadcast, global_process_set,
                      grouped_allreduce, join, local_rank_op, local_size_op,
                      process_set_included_op, rank_op, reducescatter, remove_process_set,
                      size_op)

__all__ = [
    "elastic",
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "start_timeline", "stop_timeline",
    "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "Average", "Sum", "Min", "Max", "Product", "Adasum",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "allreduce", "grouped_allreduce", "allgather", "broadcast", "alltoall", "reducescatter",
    "barrier", "join", "size_op", "rank_op", "local_size_op", "local_rank_op",
    "process_set_included_op",
    "broadcast_variables", "broadcast_global_variables", "broadcast_object", "allgather_object",
    "Compression", "DistributedGradientTape", "DistributedOptimizer",
    "grouped_allgather", "grouped_reducescatter", "broadcast_", "broadcast_object_fn",
    "PartialDistributedGradientTape", "SyncBatchNormalization",
    "HorovodInternalError", "CollectiveError", "CollectiveTimeout", "MismatchError",
    "NotSupported", "PeerLostError", "InvalidArgument",
]


def DistributedOptimizer(optimizer, name=None, device_dense: str = "", device_sparse: str = "",
                         compression=Compression.none, sparse_as_dense: bool = False,
                         backward_passes_per_step: int = 1, op=Average,
                         gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups=None, process_set=None):
    """Wrap a Keras 3 optimizer (see horovod_spark.keras.DistributedOptimizer)."""
    import keras

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a Keras 3 optimizer (keras.optimizers.*), got "
                        f"{type(optimizer).__name__}; TF1 tf.compat.v1.train optimizers are not "
                        "supported, use DistributedGradientTape in a custom loop instead")
    from ..keras.optimizer import DistributedOptimizer as _wrap

    return _wrap(optimizer, name=name, compression=compression, sparse_as_dense=sparse_as_dense,
                 backward_passes_per_step=backward_passes_per_step, op=op,
                 gradient_predivide_factor=gradient_predivide_factor,
                 average_aggregated_gradients=average_aggregated_gradients,
                 num_groups=num_groups, groups=groups, process_set=process_set)
