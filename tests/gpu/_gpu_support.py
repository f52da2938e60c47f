"""Why the GPU tests cannot run here (CuPy, NCCL, a GPU, torch with CUDA), as a skip reason;
and the NCCL backend of a world of one, which the single-process GPU tests share."""
from __future__ import annotations

import functools

import pytest


@functools.lru_cache(maxsize=None)
def nccl_skip_reason():
    from collectives.backends.nccl import available

    ok, reason = available()
    return None if ok else reason


@functools.lru_cache(maxsize=None)
def torch_cuda_skip_reason():
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA GPU"
    return nccl_skip_reason()


requires_nccl = pytest.mark.skipif(nccl_skip_reason() is not None, reason=str(nccl_skip_reason()))
requires_torch_cuda = pytest.mark.skipif(torch_cuda_skip_reason() is not None,
                                         reason=str(torch_cuda_skip_reason()))


def one_rank_backend(prefix: str):
    """An NcclBackend of a world of one on this process's GPU (the caller closes it)."""
    from collectives.backends.base import Topology
    from collectives.backends.nccl import NcclBackend
    from collectives.rendezvous.store import InMemoryStore
    from collectives.settings import Config

    return NcclBackend.create(InMemoryStore(), Topology(0, 1, ("localhost",)), prefix,
                              Config(timeout=60.0))
