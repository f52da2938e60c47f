"""The CUDA lane's device step without a GPU (native/src/cuda/runtime.h): loading the CUDA
runtime and NCCL at run time, the refusals where they are missing, the NCCL codes, and the
order of the step's calls, against a stand-in of the two libraries (_fake_cuda.c, built
here) that records each call.  On a GPU the same step runs on the real libraries (the
device check of the CUDA lane)."""
from __future__ import annotations

import ctypes
import gc
import os
import shutil
import subprocess

import pytest

from collectives import _native
from collectives._gpu import cuda_runtime, runtime_candidates
from collectives.backends import _nccl_types as T
from collectives.errors import CollectiveError, NotSupported
from collectives.types import DType, ReduceOp

HERE = os.path.dirname(os.path.abspath(__file__))
COMM, CALLER, ENGINE, SRC, DST = 0xC0, 0x51, 0x52, 0x1000, 0x2000


@pytest.fixture(scope="module")
def fakes(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in CUDA runtime and NCCL")
    out = tmp_path_factory.mktemp("fake-cuda")
    libs = {}
    for name, flag in (("cudart", "-DFAKE_CUDART"), ("nccl", "-DFAKE_NCCL")):
        path = str(out / f"libfake{name}.so")
        subprocess.run([cc, "-shared", "-fPIC", "-O1", flag, "-o", path, os.path.join(HERE, "_fake_cuda.c")],
                       check=True)
        libs[name] = path
    return libs


@pytest.fixture
def fake(fakes):
    """(runtime, cudart, nccl): the step over freshly reset stand-ins (ctypes opens the same
    instances the runtime does: one path, one library)."""
    cudart, nccl = ctypes.CDLL(fakes["cudart"]), ctypes.CDLL(fakes["nccl"])
    for lib in (cudart, nccl):
        lib.fake_reset()
        lib.fake_log.restype = ctypes.c_char_p
    nccl.fake_set_version(22105)
    return _native.CudaRuntime([fakes["cudart"]], [fakes["nccl"]]), cudart, nccl


def calls(lib) -> list:
    return lib.fake_log().decode().splitlines()


def test_without_a_cuda_runtime_the_lane_is_refused_saying_what_to_install():
    with pytest.raises(NotSupported) as info:
        _native.CudaRuntime(["libcudart.so.12", "/nowhere/libcudart.so.12"], ["libnccl.so.2"])
    text = str(info.value)
    assert "libcudart.so.12: not loaded in this process" in text, text
    assert "/nowhere/libcudart.so.12" in text and "pip install nvidia-cuda-runtime-cu12" in text, text


def test_this_cpu_only_process_gets_no_cuda_runtime_and_says_why():
    cudart, nccl = runtime_candidates()
    assert cudart[:2] == ["libcudart.so.13", "libcudart.so.12"] and nccl[0] == "libnccl.so.2"
    if any("/" in c for c in cudart + nccl):
        pytest.skip("an nvidia-* wheel is installed here")
    with pytest.raises(NotSupported, match="no CUDA runtime library"):
        cuda_runtime()


def test_runtime_candidates_find_the_nvidia_wheels_libraries(tmp_path):
    for folder, name in (("cuda_runtime", "libcudart.so.12"), ("nccl", "libnccl.so.2")):
        (tmp_path / "nvidia" / folder / "lib").mkdir(parents=True)
        (tmp_path / "nvidia" / folder / "lib" / name).write_bytes(b"")
    cudart, nccl = runtime_candidates([str(tmp_path)])
    assert cudart[-1] == str(tmp_path / "nvidia/cuda_runtime/lib/libcudart.so.12")
    assert nccl == ["libnccl.so.2", str(tmp_path / "nvidia/nccl/lib/libnccl.so.2")]


def test_a_library_without_an_entry_point_is_named(fakes):
    with pytest.raises(NotSupported) as info:  # NCCL's stand-in has no CUDA entry points
        _native.CudaRuntime([fakes["nccl"]], [fakes["nccl"]])
    assert f"cudaEventCreateWithFlags is missing from {fakes['nccl']}" in str(info.value)
    with pytest.raises(NotSupported, match="ncclAllReduce is missing from"):
        _native.CudaRuntime([fakes["cudart"]], [fakes["cudart"]])


def test_the_step_fences_nccl_between_events_on_the_callers_stream(fakes, fake):
    _, cudart, nccl = fake  # (the fixture's runtime asked for the version too)
    rt = _native.CudaRuntime([fakes["cudart"]], [fakes["nccl"]])
    assert rt.nccl_version == 22105 and rt.libraries[1].endswith("libfakenccl.so")
    for _ in range(2):
        rt.allreduce(COMM, CALLER, ENGINE, SRC, DST, 1000, int(DType.FLOAT32), int(ReduceOp.SUM))
    cuda = calls(cudart)
    # two events, made once, without timing (flag 2), then per op: ready on the caller's
    # stream, the engine's stream waits; done on the engine's, the caller's waits
    assert cuda[:2] == ["cudaEventCreateWithFlags 0xe1 2", "cudaEventCreateWithFlags 0xe2 2"], cuda
    per_op = ["cudaEventRecord 0xe1 0x51", "cudaStreamWaitEvent 0x52 0xe1 0",
              "cudaEventRecord 0xe2 0x52", "cudaStreamWaitEvent 0x51 0xe2 0"]
    assert cuda[2:] == per_op * 2, cuda
    assert calls(nccl) == ["ncclGetVersion"] * 2 + ["ncclAllReduce 0x1000 0x2000 1000 7 0 0xc0 0x52"] * 2
    del rt  # its events go with it
    gc.collect()
    assert calls(cudart)[-2:] == ["cudaEventDestroy 0xe1", "cudaEventDestroy 0xe2"]


def test_one_stream_for_both_needs_no_events_and_nothing_moves_for_no_elements(fake):
    rt, cudart, nccl = fake
    rt.allreduce(COMM, ENGINE, ENGINE, SRC, SRC, 7, int(DType.FLOAT16), int(ReduceOp.MAX))
    rt.allreduce(COMM, CALLER, ENGINE, SRC, DST, 0, int(DType.FLOAT32), int(ReduceOp.SUM))
    assert calls(cudart) == []
    assert calls(nccl)[1:] == ["ncclAllReduce 0x1000 0x1000 7 6 2 0xc0 0x52"]


@pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.name)
def test_nccl_codes_are_those_of_the_nccl_backends_plan(fake, dtype):
    rt, _, nccl = fake
    plan = T.reduce_plan(dtype, ReduceOp.MIN, 22105)
    if dtype in (DType.BOOL, DType.INT16):  # the backend lowers them first (uint8, int32)
        with pytest.raises(NotSupported, match=f"NCCL reduces no {dtype.name.lower()}"):
            rt.allreduce(COMM, CALLER, ENGINE, SRC, DST, 4, int(dtype), int(ReduceOp.MIN))
        return
    rt.allreduce(COMM, CALLER, ENGINE, SRC, DST, 4, int(dtype), int(ReduceOp.MIN))
    assert calls(nccl)[-1] == f"ncclAllReduce 0x1000 0x2000 4 {plan.nccl_type} {T.NCCL_MIN} 0xc0 0x52"


def test_average_and_bfloat16_need_nccl_2_10_and_adasum_is_refused(fakes, fake):
    rt, _, nccl = fake
    rt.allreduce(COMM, CALLER, ENGINE, SRC, DST, 3, int(DType.FLOAT32), int(ReduceOp.AVERAGE))
    assert calls(nccl)[-1].split()[4:6] == ["7", "4"]  # ncclAvg
    with pytest.raises(NotSupported, match="NCCL has no reduce op adasum"):
        rt.allreduce(COMM, CALLER, ENGINE, SRC, DST, 3, int(DType.FLOAT32), int(ReduceOp.ADASUM))
    nccl.fake_set_version(2804)  # NCCL 2.8.4
    old = _native.CudaRuntime([fakes["cudart"]], [fakes["nccl"]])
    with pytest.raises(NotSupported, match="NCCL 2804 has no average"):
        old.allreduce(COMM, CALLER, ENGINE, SRC, DST, 3, int(DType.FLOAT32), int(ReduceOp.AVERAGE))
    with pytest.raises(NotSupported, match="reduces no bfloat16"):
        old.allreduce(COMM, CALLER, ENGINE, SRC, DST, 3, int(DType.BFLOAT16), int(ReduceOp.SUM))


def test_failures_name_the_call_and_keep_the_librarys_words(fake):
    rt, cudart, nccl = fake
    nccl.fake_fail(b"ncclAllReduce", 2)
    with pytest.raises(CollectiveError) as info:
        rt.allreduce(COMM, CALLER, ENGINE, SRC, DST, 5, int(DType.FLOAT64), int(ReduceOp.SUM))
    assert "ncclAllReduce of 5 float64 failed: NCCL error 2 (unhandled system error)" in str(info.value)
    assert calls(cudart)[-1] == "cudaStreamWaitEvent 0x52 0xe1 0"  # nothing queued after it
    cudart.fake_fail(b"cudaStreamWaitEvent", 700)
    with pytest.raises(CollectiveError, match="cudaStreamWaitEvent on the engine's stream failed: "
                                              r"CUDA error 700 \(an illegal memory access"):
        rt.allreduce(COMM, CALLER, ENGINE, SRC, DST, 5, int(DType.FLOAT64), int(ReduceOp.SUM))


def test_bad_arguments_are_value_errors(fake):
    rt, _, _ = fake
    with pytest.raises(ValueError, match="no NCCL communicator"):
        rt.allreduce(0, CALLER, ENGINE, SRC, DST, 5, int(DType.FLOAT32), int(ReduceOp.SUM))
    with pytest.raises(ValueError, match="null buffer"):
        rt.allreduce(COMM, CALLER, ENGINE, 0, DST, 5, int(DType.FLOAT32), int(ReduceOp.SUM))
    with pytest.raises(ValueError, match="unknown dtype code 99"):
        rt.allreduce(COMM, CALLER, ENGINE, SRC, DST, 5, 99, int(ReduceOp.SUM))
