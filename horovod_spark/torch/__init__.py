"""Horovod's torch API over horovod_spark's collectives: port a script by its import.

    import horovod_spark.torch as hvd
    hvd.init()
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

Every op goes through the fusion engine that `init()` starts (HOROVOD_CYCLE_TIME,
HOROVOD_FUSION_THRESHOLD, HOROVOD_TIMELINE, HOROVOD_STALL_CHECK_TIME_SECONDS
apply); `metrics()` reports step time, allreduce time and bytes reduced.
CPU tensors of every dtype (bfloat16 included) and CUDA tensors (through the
communicator's GPU backend) are accepted.
"""
from __future__ import annotations

from ..common.exceptions import HorovodInternalError
from collectives.errors import (CollectiveError, CollectiveTimeout, MismatchError, NotSupported,
                                PeerLostError)

from ._errors import InvalidArgument
from ._compat import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled, mpi_built,
                      mpi_enabled, mpi_threads_supported, nccl_built, rocm_built)
from ._state import (cross_rank, cross_size, init, is_homogeneous, is_initialized, local_rank,
                     local_size, metrics, rank, shutdown, size, start_timeline, stop_timeline)
from .compression import Compression
from . import c10d  # registers the "hvs" torch.distributed backend
from . import elastic
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters)
from .mpi_ops import (Adasum, Average, Max, Min, Product, ProcessSet, Sum, add_process_set,
                      allgather_async, allreduce_async, allreduce_async_, alltoall_async, barrier,
                      broadcast_async, broadcast_async_, global_process_set,
                      grouped_allgather_async, grouped_allreduce_async, grouped_allreduce_async_,
                      grouped_reducescatter_async, join, poll, reducescatter_async, sparse_allreduce_async,
                      remove_process_set, synchronize)
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm
from .sync_ops import (allgather, allreduce, allreduce_, alltoall, broadcast, broadcast_,
                       grouped_allgather, grouped_allreduce, grouped_allreduce_,
                       grouped_reducescatter, reducescatter)

__all__ = [
    "elastic",
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "metrics", "start_timeline", "stop_timeline",
    "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "ProcessSet", "global_process_set",
    "add_process_set", "remove_process_set",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "allgather", "allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_allgather", "grouped_allgather_async", "grouped_reducescatter",
    "grouped_reducescatter_async", "sparse_allreduce_async",
    "synchronize", "poll", "join", "barrier",
    "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object",
    "Compression", "DistributedOptimizer", "SyncBatchNorm",
    "HorovodInternalError", "CollectiveError", "CollectiveTimeout", "MismatchError",
    "NotSupported", "PeerLostError", "InvalidArgument",
]
