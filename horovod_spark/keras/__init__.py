"""Horovod's Keras API for Keras 3: `import horovod_spark.keras as hvd`.

    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size())),
                  loss="mse", jit_compile=False)
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback()])

The value functions (allreduce, allgather, broadcast, reducescatter) take
numbers, numpy arrays or tensors and return numpy arrays, as Horovod's do.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..tensorflow import (Adasum, Average, Compression, Max, Min, Product, ProcessSet, Sum,
                          add_process_set, allgather_object, global_process_set,
                          remove_process_set,
                          barrier, broadcast_global_variables, broadcast_object,
                          broadcast_variables, ccl_built, cross_rank, cross_size, cuda_built,
                          ddl_built, gloo_built, gloo_enabled, init, is_homogeneous,
                          is_initialized, join, local_rank, local_size, mpi_built, mpi_enabled,
                          mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size,
                          start_timeline, stop_timeline)
from ..tensorflow import mpi_ops as _ops
from . import callbacks
from . import elastic
from .optimizer import DistributedOptimizer, PartialDistributedOptimizer, make_distributed

__all__ = [
    "elastic",
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "start_timeline", "stop_timeline", "Average", "Sum", "Min", "Max", "Product", "Adasum",
    "allreduce", "allgather", "broadcast", "reducescatter", "broadcast_object",
    "allgather_object", "broadcast_variables", "join", "barrier", "Compression",
    "DistributedOptimizer", "PartialDistributedOptimizer", "load_model", "callbacks",
    "broadcast_global_variables", "mpi_threads_supported", "mpi_enabled", "mpi_built",
    "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
    "rocm_built", "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
]


def allreduce(value, name: Optional[str] = None, average=None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, op=None, compression=Compression.none,
              process_set=global_process_set) -> np.ndarray:
    """`value` reduced over ranks (default: Average), as a numpy array."""
    return np.asarray(_ops.allreduce(value, average=average, compression=compression, op=op,
                                     prescale_factor=prescale_factor,
                                     postscale_factor=postscale_factor, name=name,
                                     process_set=process_set))


def allgather(value, name: Optional[str] = None, process_set=global_process_set) -> np.ndarray:
    """Every rank's `value` concatenated along dim 0, as a numpy array."""
    return np.asarray(_ops.allgather(value, name=name, process_set=process_set))


def broadcast(value, root_rank: int = 0, name: Optional[str] = None,
              process_set=global_process_set) -> np.ndarray:
    """root_rank's `value`, as a numpy array."""
    return np.asarray(_ops.broadcast(value, root_rank, name=name, process_set=process_set))


def reducescatter(value, name: Optional[str] = None, op=Average,
                  process_set=global_process_set) -> np.ndarray:
    """`value` reduced over ranks; this rank's block of rows, as a numpy array."""
    return np.asarray(_ops.reducescatter(value, op=op, name=name, process_set=process_set))


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=Compression.none, **optimizer_kwargs):
    """keras.models.load_model, with the saved optimizer (and its state) made distributed.

    Args:
        custom_optimizers: optimizer classes the file may name, besides Keras's own.
        optimizer_kwargs: DistributedOptimizer's other arguments (op, sparse_as_dense, ...).
    """
    import keras

    objects = dict(custom_objects or {})
    objects.update({cls.__name__: cls for cls in (custom_optimizers or [])})
    model = keras.models.load_model(filepath, custom_objects=objects or None, compile=True)
    if getattr(model, "optimizer", None) is not None:
        make_distributed(model.optimizer, compression=compression, **optimizer_kwargs)
    return model
