"""GPU placement and CUDA buffers, without importing a GPU library until needed.

Terms: an *address* is the GPU's name in Spark's resource scheduling (what a
discovery script prints, usually the physical CUDA index "0", "1", ...); an
*ordinal* is the CUDA device index inside this process, after
`CUDA_VISIBLE_DEVICES` has renumbered the visible GPUs from 0; a GPU's
*identity* is its PCI bus id, which no renumbering changes, so two ranks on
one host with the same identity share a GPU, whatever their ordinals say.

A *CUDA buffer* is a torch CUDA tensor, or any object with
`__cuda_array_interface__` (CuPy, Numba) or a DLPack device of type CUDA.
`DeviceBuffer` is its flat view: pointer, element count, device, and the
framework whose current stream orders the op.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from typing import Any, Mapping, Optional, Sequence, Tuple

from .errors import CollectiveError, NotSupported, describe

__all__ = ["select_device", "is_cuda_buffer", "check_exclusive_gpus", "gpu_addresses",
           "DeviceBuffer", "device_buffer", "torch_stream", "current_stream", "import_cupy_nccl", "import_or_refuse",
           "NCCL_INSTALL_HINT", "cuda_runtime", "runtime_candidates"]

_SPARK_GPU_HINT = ("give every task its own GPU: spark.task.resource.gpu.amount=1 and "
                   "spark.executor.resource.gpu.amount = tasks per executor")
_DLPACK_CUDA = (2, 13)  # kDLCUDA, kDLCUDAManaged (3 is pinned host memory)
NCCL_INSTALL_HINT = 'pip install cupy-cuda12x "nvidia-nccl-cu12>=2.18" (match your CUDA major version)'
_NCCL_LIB_HINT = 'pip install "nvidia-nccl-cu12>=2.18"'
_NO_NCCL = "CuPy cannot load NCCL (libnccl.so.2)"


def import_or_refuse(backend: str, module: str, missing: str, hint: str,
                     errors: Tuple[type, ...] = (ImportError,)):
    """`module`, imported; or NotSupported saying that `backend` is not available and why.

    Args:
        missing: what is wrong when the import fails ("mpi4py is not installed").
        errors: the exceptions that mean it failed (a library that loads a shared
            object may raise OSError or RuntimeError too).
    """
    try:
        return importlib.import_module(module)
    except errors as exc:
        lines = str(exc).strip().splitlines()
        detail = f" ({'; '.join(lines[:3])})" if lines else ""
        raise NotSupported(describe(f"backend {backend} is not available: {missing}{detail}",
                                    hint=hint)) from exc


def gpu_addresses(resources: Mapping[str, Any], name: str = "gpu") -> Tuple[str, ...]:
    """The addresses of resource `name` in `TaskContext.resources()` (or a plain dict of lists)."""
    info = resources.get(name) if resources else None
    if info is None:
        return ()
    addresses = getattr(info, "addresses", info)  # pyspark ResourceInformation, or a list
    if isinstance(addresses, str):
        addresses = [addresses]
    return tuple(str(a).strip() for a in addresses)


def select_device(resources: Mapping[str, Any], environ: Mapping[str, str]) -> int:
    """The CUDA ordinal this rank uses: its first Spark-assigned GPU, as this process sees it.

    With `CUDA_VISIBLE_DEVICES` set (the task sets it to the assigned
    addresses), the ordinal is the address's position in that list, so
    usually 0; without it, the address is the ordinal.

    Raises:
        ValueError: no GPU is assigned, or the assigned GPU is not visible.
    """
    addresses = gpu_addresses(resources)
    if not addresses:
        raise ValueError("select_device: this task has no GPU among its Spark resources "
                         f"({sorted(resources) if resources else 'none'}); set "
                         "spark.task.resource.gpu.amount=1 and a GPU discovery script")
    address = addresses[0]
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        names = [v.strip() for v in visible.split(",") if v.strip()]
        if address in names:
            return names.index(address)
        raise ValueError(f"select_device: the task's GPU {address!r} is not in "
                         f"CUDA_VISIBLE_DEVICES={visible!r}; the rank process must see the GPU "
                         "Spark assigned (set CUDA_VISIBLE_DEVICES from TaskContext.resources())")
    try:
        ordinal = int(address)
    except ValueError:
        raise ValueError(f"select_device: GPU address {address!r} is not a CUDA index and "
                         "CUDA_VISIBLE_DEVICES is not set; set CUDA_VISIBLE_DEVICES to it") from None
    if ordinal < 0:
        raise ValueError(f"select_device: GPU address {address!r} is negative")
    return ordinal


def check_exclusive_gpus(assignments: Sequence[Tuple[int, str, str]], size: Optional[int] = None) -> None:
    """Refuse ranks that share a GPU.

    Args:
        assignments: (rank, host, GPU identity or address) for every rank.

    Raises:
        CollectiveError: naming the ranks, their host and the GPU.
    """
    owner: dict = {}
    clashes: dict = {}
    for rank, host, gpu in assignments:
        key = (host, gpu)
        if key in owner:
            clashes.setdefault(key, [owner[key]]).append(rank)
        else:
            owner[key] = rank
    if not clashes:
        return
    parts = [f"ranks {', '.join(map(str, sorted(ranks)))} on host {host} share GPU {gpu}"
             for (host, gpu), ranks in sorted(clashes.items(), key=lambda kv: min(kv[1]))]
    raise CollectiveError(describe("; ".join(parts), op="nccl init",
                                   size=size or len(assignments), hint=_SPARK_GPU_HINT))


def is_cuda_buffer(x) -> bool:
    """Whether x lives in CUDA device memory (torch CUDA tensor, CuPy array, DLPack CUDA)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return bool(x.is_cuda)
    if hasattr(x, "__cuda_array_interface__"):
        return True
    dev = getattr(x, "__dlpack_device__", None)
    if dev is not None:
        try:
            return int(dev()[0]) in _DLPACK_CUDA
        except Exception:  # noqa: BLE001 - a foreign object's DLPack query failed
            return False
    return False


@dataclasses.dataclass(frozen=True)
class DeviceBuffer:
    """A flat, contiguous CUDA buffer: what the NCCL backend hands to NCCL."""

    ptr: int
    count: int          # elements
    itemsize: int
    device: int
    framework: str      # "torch" or "cupy"
    owner: Any          # keeps the memory alive

    @property
    def nbytes(self) -> int:
        return self.count * self.itemsize

    def at(self, offset: int) -> int:
        """The address of element `offset`."""
        return self.ptr + offset * self.itemsize


def torch_stream(x) -> int:
    """torch's current stream on CUDA tensor x's device, as a cudaStream_t int (through
    torch's raw getter where it has one: a Stream object costs microseconds per op)."""
    torch = sys.modules["torch"]
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(x.device.index))
    return int(torch.cuda.current_stream(x.device).cuda_stream)


def current_stream(x, device: int, cupy) -> int:
    """The current stream (cudaStream_t as int) of x's framework on `device`: torch's for
    a torch tensor, else CuPy's (x may be None)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return torch_stream(x)
    try:
        return int(cupy.cuda.get_current_stream(device).ptr)
    except TypeError:  # CuPy < 13 takes no device
        return int(cupy.cuda.get_current_stream().ptr)


def device_buffer(x, what: str = "tensor") -> DeviceBuffer:
    """The DeviceBuffer of a CUDA buffer, zero-copy.

    Raises:
        TypeError: x is not a CUDA buffer.
        ValueError: x is not contiguous.
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        if not x.is_cuda:
            raise TypeError(f"{what}: a CPU tensor reached the NCCL backend; pass a CUDA tensor")
        if not x.is_contiguous():
            raise ValueError(f"{what}: the CUDA tensor is not contiguous; call .contiguous() first")
        return DeviceBuffer(x.data_ptr(), x.numel(), x.element_size(), x.device.index, "torch", x)
    if not is_cuda_buffer(x):
        raise TypeError(f"{what}: expected a CUDA buffer (torch CUDA tensor, CuPy array), "
                        f"got {type(x).__name__}")
    if not hasattr(x, "__cuda_array_interface__"):  # DLPack only
        import cupy

        x = cupy.from_dlpack(x)  # zero-copy
    iface = getattr(x, "__cuda_array_interface__", None)
    if iface is None:
        raise TypeError(f"{what}: expected a CUDA buffer (torch CUDA tensor, CuPy array), "
                        f"got {type(x).__name__}")
    return _from_interface(x, iface, what)


def _from_interface(x, iface: dict, what: str) -> DeviceBuffer:
    import numpy as np

    itemsize = np.dtype(iface["typestr"]).itemsize
    count = 1
    for d in iface["shape"]:
        count *= int(d)
    strides = iface.get("strides")
    if strides is not None and count > 1:
        expect, ok = itemsize, True
        for d, s in zip(reversed(iface["shape"]), reversed(strides)):
            ok = ok and (int(d) == 1 or int(s) == expect)
            expect *= int(d)
        if not ok:
            raise ValueError(f"{what}: the CUDA array is not C-contiguous; "
                             "pass cupy.ascontiguousarray(x)")
    ptr = int(iface["data"][0])
    device = getattr(getattr(x, "device", None), "id", None)
    if device is None:
        import cupy

        device = cupy.cuda.runtime.pointerGetAttributes(ptr).device if ptr else 0
    return DeviceBuffer(ptr, count, itemsize, int(device), "cupy", x)


def import_cupy_nccl():
    """(cupy, cupy.cuda.nccl), or NotSupported saying what is missing."""
    cupy = import_or_refuse("nccl", "cupy", "CuPy is not installed", NCCL_INSTALL_HINT)
    nccl = import_or_refuse("nccl", "cupy.cuda.nccl", _NO_NCCL, _NCCL_LIB_HINT)
    if not getattr(nccl, "available", False) or not hasattr(nccl, "NcclCommunicator"):
        raise NotSupported(describe(f"backend nccl is not available: {_NO_NCCL}", hint=_NCCL_LIB_HINT))
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - CUDARuntimeError: no driver, no device
        raise NotSupported(describe(f"backend nccl is not available: no usable CUDA device ({exc})",
                                    hint="run on a machine with an NVIDIA GPU and driver")) from exc
    if count < 1:
        raise NotSupported(describe("backend nccl is not available: CUDA sees no GPU",
                                    hint="check CUDA_VISIBLE_DEVICES and the task's GPU resources"))
    return cupy, nccl


#: The CUDA runtime's and NCCL's sonames, newest first: what CuPy and torch load.
_CUDART_NAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so")
_NCCL_NAMES = ("libnccl.so.2",)
_runtime: list = []


def runtime_candidates(paths: Optional[Sequence[str]] = None) -> Tuple[list, list]:
    """(cudart, nccl): the names the CUDA lane tries, then the nvidia-* wheels' libraries
    under `paths` (nvidia/cuda_runtime/lib, nvidia/nccl/lib), as `_native.CudaRuntime` takes
    them: a name must be loaded already, a path is loaded."""
    cudart, nccl = list(_CUDART_NAMES), list(_NCCL_NAMES)
    for root in sys.path if paths is None else paths:
        for folder, names, out in (("cuda_runtime", _CUDART_NAMES, cudart), ("nccl", _NCCL_NAMES, nccl)):
            lib = os.path.join(root or ".", "nvidia", folder, "lib")
            out.extend(p for p in (os.path.join(lib, n) for n in names) if os.path.isfile(p))
    return cudart, nccl


def cuda_runtime():
    """The CUDA lane's device step (`_native.CudaRuntime`: the CUDA runtime and NCCL this
    process loaded, else the nvidia-* wheels'), made once; NotSupported saying what is
    missing."""
    if not _runtime:
        from . import _native

        _runtime.append(_native.CudaRuntime(*runtime_candidates()))
    return _runtime[0]
