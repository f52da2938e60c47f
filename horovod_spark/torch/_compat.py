"""Horovod's build and runtime queries, answered for this package.

The framework-free ones live in `horovod_spark.common.basics`; only the CUDA / ROCm
build questions depend on the framework.
"""
from __future__ import annotations

from ..common.basics import ccl_built, ddl_built, gloo_built, gloo_enabled, mpi_built, nccl_built
from ._state import STATE

__all__ = ["mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
           "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built"]

mpi_enabled = STATE.mpi_enabled
mpi_threads_supported = STATE.mpi_threads_supported


def cuda_built() -> bool:
    import torch

    return torch.cuda.is_available()


def rocm_built() -> bool:
    return False
