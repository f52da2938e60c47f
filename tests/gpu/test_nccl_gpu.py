"""The NCCL backend on a real GPU: every op x dtype x count against numpy, CuPy and torch buffers.

World size 1 runs on any one-GPU machine (NCCL still runs its kernels, and
every code path here, widening, scaling, grouped calls, errors, runs);
tests/gpu/_gpu_world.py runs the same checks across two ranks: one GPU each
where there are two, else both on GPU 0 as two NCCL hosts (_shared_gpu.py).  Skipped with the reason where CuPy, NCCL or a GPU is missing.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from _gpu_support import one_rank_backend, requires_nccl, requires_torch_cuda

from collectives.errors import CollectiveError
from collectives.types import DType, ReduceOp, numpy_of_dtype

pytestmark = [pytest.mark.gpu, requires_nccl]

COUNTS = (0, 1, 17, 300_001)
OPS = (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT)
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def backend():
    b = one_rank_backend("gpu-test/comm0")
    yield b
    b.close()
    b.close()  # safe twice


def _host(dtype: DType, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng([int(dtype), n, seed])
    v = rng.integers(-4, 5, n)
    if dtype == DType.BOOL:
        return v > 0
    if dtype == DType.UINT8:
        v = np.abs(v)
    if dtype == DType.BFLOAT16:
        return (v.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return v.astype(numpy_of_dtype(dtype))


def _dev(a: np.ndarray):
    import cupy

    return cupy.asarray(a)


def _back(x) -> np.ndarray:
    import cupy

    cupy.cuda.get_current_stream().synchronize()
    return cupy.asnumpy(x)


@pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.name)
def test_allreduce_of_one_rank_is_the_input_for_every_op_and_count(backend, dtype):
    for n in COUNTS:
        for op in OPS:
            a = _host(dtype, n)
            src, dst = _dev(a), _dev(np.zeros_like(a))
            backend.allreduce(src, dst, dtype, op)
            assert np.array_equal(_back(dst), a), (dtype, op, n)
            backend.allreduce(src, src, dtype, op)  # in place
            assert np.array_equal(_back(src), a), (dtype, op, n)


@pytest.mark.parametrize("dtype", [DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64])
def test_prescale_and_postscale_run_on_the_gpu_in_the_buffers_precision(backend, dtype):
    from collectives.backends._mpi_types import bf16_to_f32, f32_to_bf16

    a = _host(dtype, 1001)
    src, dst = _dev(a), _dev(np.zeros_like(a))
    backend.allreduce_tensor(src, dst, dtype, ReduceOp.SUM, prescale=4.0, postscale=0.125)
    got = _back(dst)
    if dtype == DType.BFLOAT16:
        assert np.array_equal(got, f32_to_bf16(bf16_to_f32(a) * 4.0 * 0.125))
    else:
        assert np.array_equal(got, a * a.dtype.type(4.0) * a.dtype.type(0.125))
    assert np.array_equal(_back(src), a)  # prescale went to dst, not into the input


@pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.name)
def test_allgather_broadcast_reducescatter_alltoall_of_one_rank(backend, dtype):
    for n in COUNTS:
        a = _host(dtype, n)
        out = _dev(np.zeros_like(a))
        backend.allgather(_dev(a), out, dtype, [n])
        assert np.array_equal(_back(out), a)
        buf = _dev(a)
        backend.broadcast(buf, dtype, 0)
        assert np.array_equal(_back(buf), a)
        out = _dev(np.zeros_like(a))
        backend.reducescatter(_dev(a), out, dtype, ReduceOp.SUM, [n])
        assert np.array_equal(_back(out), a)
        out = _dev(np.zeros_like(a))
        backend.alltoall(_dev(a), [n], out, [n], dtype)
        assert np.array_equal(_back(out), a)


@requires_torch_cuda
def test_torch_cuda_tensors_are_reduced_in_place_on_torchs_current_stream(backend):
    import torch

    x = torch.arange(1 << 20, dtype=torch.bfloat16, device="cuda") % 7
    want = (x.float() * 0.5).to(torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # (outside: inside, current_stream() is side)
    with torch.cuda.stream(side):
        backend.allreduce_tensor(x, x, DType.BFLOAT16, ReduceOp.SUM, postscale=0.5)
    side.synchronize()
    assert torch.equal(x, want)


@requires_torch_cuda
def test_the_communicator_picks_nccl_for_cuda_tensors_and_averages():
    import torch

    import collectives

    comm = collectives.init()
    try:
        x = torch.full((3, 5), 6.0, device="cuda")
        y = comm.allreduce(x, op=ReduceOp.AVERAGE)
        assert y.is_cuda and torch.equal(y, x)
        b = torch.arange(4.0, device="cuda")
        comm.broadcast(b, root=0)
        assert torch.equal(b.cpu(), torch.arange(4.0))
    finally:
        comm.close()


def test_an_nccl_argument_error_carries_nccls_words_rank_and_op(backend):
    buf = _dev(np.zeros(4, np.float32))
    with pytest.raises(CollectiveError) as err:
        backend.broadcast(buf, DType.FLOAT32, root=3)  # no rank 3 in a world of one
    text = str(err.value)
    assert "broadcast #" in text and "on rank 0/1" in text and "NCCL error: " in text
    assert "NCCL_ERROR_INVALID_ARGUMENT" in text, text
    backend.barrier()  # an argument error leaves the communicator usable


def test_a_buffer_of_the_wrong_width_is_refused_at_the_call(backend):
    with pytest.raises(ValueError, match="4-byte elements do not hold float64"):
        backend.allreduce(_dev(np.zeros(4, np.float32)), _dev(np.zeros(4, np.float32)),
                          DType.FLOAT64, ReduceOp.SUM)


def test_barrier_and_synchronize_return_once_the_gpu_is_done(backend):
    big = _dev(np.ones(1 << 24, np.float32))
    backend.allreduce(big, big, DType.FLOAT32, ReduceOp.SUM)
    backend.barrier()
    backend.synchronize(timeout=30)


def _ranks_command(script: str, n: int, *args: str) -> list:
    """n ranks of script: one GPU each where there are n GPUs, else all on GPU 0, each its
    own NCCL host (tests/gpu/_shared_gpu.py)."""
    import cupy

    launch = [sys.executable, "-m", "collectives.launch", "-n", str(n)]
    if cupy.cuda.runtime.getDeviceCount() >= n:
        return launch + [script, *args]
    hosts = ",".join(f"gpu-host-{r}" for r in range(n))
    return launch + ["--hosts", hosts, os.path.join(HERE, "_shared_gpu.py"), script, *args]


def _run_ranks(script: str, n: int, ok: str) -> None:
    """Run tests/gpu/<script> as n ranks (directly for one); each must print `ok`."""
    path = os.path.join(HERE, script)
    cmd = [sys.executable, path] if n == 1 else _ranks_command(path, n)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    assert proc.stdout.count(ok) == n, proc.stdout[-6000:]


def test_every_op_matches_numpy_across_two_ranks():
    _run_ranks("_gpu_world.py", 2, "GPU WORLD OK")


@requires_torch_cuda
@pytest.mark.parametrize("n", [1, 2])
def test_a_cnn_trains_on_cuda_with_distributed_optimizer_like_one_full_batch_process(n):
    _run_ranks("_gpu_cnn.py", n, "GPU CNN OK")


@requires_torch_cuda
@pytest.mark.parametrize("n", [1, 2])
def test_hvd_ops_wait_for_the_callers_side_stream_and_their_results_are_ready_on_it(n):
    _run_ranks("_gpu_streams.py", n, "GPU STREAMS OK")
