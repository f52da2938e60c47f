"""The CUDA lane's device step on a real GPU (native/src/cuda/runtime.h): it loads the NCCL
CuPy loaded (the same version, so CuPy's communicator is valid in it), and an allreduce on
an engine stream, fenced by events, lands after the caller's earlier work on its stream
and before its later work.  One rank: NCCL still runs its kernels.  Skipped with the
reason where CuPy, NCCL, a GPU or torch with CUDA is missing."""
from __future__ import annotations

import pytest

from _gpu_support import one_rank_backend, requires_nccl, requires_torch_cuda

from collectives.types import DType, ReduceOp

pytestmark = [pytest.mark.gpu, requires_nccl, requires_torch_cuda]


@pytest.fixture(scope="module")
def backend():
    b = one_rank_backend("cuda-lane/comm0")
    yield b
    b.close()


def test_the_device_step_uses_cupys_nccl(backend):
    from collectives._gpu import cuda_runtime

    rt = cuda_runtime()
    assert rt.nccl_version == int(backend._nccl.get_version()), rt.libraries


def test_an_allreduce_is_ordered_between_the_callers_earlier_and_later_work(backend):
    import torch

    from collectives._gpu import cuda_runtime

    rt = cuda_runtime()
    n = 1 << 20
    x = torch.arange(n, device="cuda", dtype=torch.float32)
    out = torch.zeros_like(x)
    caller, engine = torch.cuda.Stream(), torch.cuda.Stream()
    caller.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(caller):
        torch.cuda._sleep(100_000_000)  # the caller's stream is busy for a while...
        x.mul_(2)  # ...then writes the input: the allreduce must wait for this
        rt.allreduce(backend._comm.ptr, caller.cuda_stream, engine.cuda_stream, x.data_ptr(),
                     out.data_ptr(), n, int(DType.FLOAT32), int(ReduceOp.SUM))
        later = out + 1  # and this must see the result
    torch.cuda.synchronize()
    want = torch.arange(n, device="cuda", dtype=torch.float32) * 2
    assert torch.equal(out, want)
    assert torch.equal(later, want + 1)
