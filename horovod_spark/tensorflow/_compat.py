"""Horovod's build and runtime queries, answered for this package."""
from __future__ import annotations

import importlib.util

from . import _basics

__all__ = ["mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
           "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built"]


def mpi_enabled() -> bool:
    """Whether this job's communicator runs on MPI (ranks started by mpiexec)."""
    return _basics.communicator().backend_name == "mpi"


def mpi_threads_supported() -> bool:
    """Ops may come from any thread: the fusion engine alone talks to the backend."""
    _basics.communicator()
    return True


def mpi_built() -> bool:
    return importlib.util.find_spec("mpi4py") is not None


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> bool:
    """Whether CuPy's NCCL is importable; TensorFlow tensors travel through host memory."""
    return importlib.util.find_spec("cupy") is not None


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    import tensorflow as tf

    return bool(tf.test.is_built_with_cuda())


def rocm_built() -> bool:
    import tensorflow as tf

    return bool(tf.test.is_built_with_rocm())
