"""Turn user tensors into flat buffers and back, without copying.

A *tensor* is a numpy array, a torch tensor, or anything with the buffer
protocol.  A `Buf` is its flat C-contiguous numpy view, the logical `DType`,
and a `wrap` function that turns a numpy result of the same storage dtype back
into the caller's kind (torch in, torch out).  bfloat16 travels as uint16.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable

import numpy as np

from .types import _FROM_NUMPY, DType, dtype_of_numpy, numpy_of_dtype

__all__ = ["Buf", "as_buf", "empty_for", "scale_", "describe_tensor", "is_cuda"]


@dataclasses.dataclass
class Buf:
    flat: Any              # 1-D, C-contiguous view of the caller's memory (device array for CUDA)
    dtype: DType
    shape: tuple
    wrap: Callable[[np.ndarray], Any]
    kind: str              # "numpy", "torch" or "cuda"
    source: Any = None     # the caller's object (CUDA tensors travel as is)


def _is_torch(x) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def is_cuda(x) -> bool:
    if _is_torch(x):
        return x.is_cuda
    return hasattr(x, "__cuda_array_interface__")


def _torch_buf(x, writable: bool, what: str) -> Buf:
    import torch

    if not x.is_contiguous():
        if writable:
            raise ValueError(f"{what}: the tensor is not contiguous and the op writes into it; "
                             "call .contiguous() first")
        x = x.contiguous()
    t = x.detach()
    if t.dtype == torch.bfloat16:
        arr = t.view(torch.int16).numpy().view(np.uint16)
        dt = DType.BFLOAT16

        def wrap(a: np.ndarray):
            return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    else:
        try:
            arr = t.numpy()
        except TypeError as exc:
            raise TypeError(f"{what}: unsupported tensor dtype {t.dtype} ({exc})") from None
        dt = dtype_of_numpy(arr.dtype)
        wrap = torch.from_numpy
    return Buf(arr.reshape(-1), dt, tuple(x.shape), wrap, "torch", x)


def _same(a):
    return a


def as_buf(x, *, writable: bool = False, what: str = "tensor") -> Buf:
    """Flat view of x.  writable: the op writes into x, so no hidden copy is allowed."""
    if type(x) is np.ndarray and x.flags.c_contiguous and (x.flags.writeable or not writable):
        dt = _FROM_NUMPY.get(x.dtype)  # the hot path: a plain contiguous array
        if dt is not None:
            return Buf(x.reshape(-1), dt, x.shape, _same, "numpy", x)
    if is_cuda(x):
        if writable and not _cuda_contiguous(x):
            raise ValueError(f"{what}: the CUDA tensor is not contiguous and the op writes into it; "
                             "call .contiguous() first")
        return Buf(_cuda_flat(x), _cuda_dtype(x), tuple(x.shape), lambda a: a, "cuda", x)
    if _is_torch(x):
        return _torch_buf(x, writable, what)
    if not isinstance(x, np.ndarray):
        if writable:
            raise TypeError(f"{what}: expected a numpy array or torch tensor, got {type(x).__name__}")
        x = np.asarray(x)
    if not x.flags.c_contiguous:
        if writable:
            raise ValueError(f"{what}: the array is not C-contiguous and the op writes into it; "
                             "pass np.ascontiguousarray(x)")
        x = np.ascontiguousarray(x)
    if writable and not x.flags.writeable:
        raise ValueError(f"{what}: the array is read-only and the op writes into it")
    dt = dtype_of_numpy(x.dtype)
    return Buf(x.reshape(-1), dt, x.shape, _same, "numpy", x)


def _cuda_contiguous(x) -> bool:
    if _is_torch(x):
        return x.is_contiguous()
    return bool(x.flags.c_contiguous)


def _cuda_flat(x):
    """A flat view of a CUDA tensor (a contiguous copy only when x is not contiguous)."""
    if _is_torch(x):
        return x.detach().contiguous().view(-1)
    from ._gpu import import_cupy_nccl

    cupy, _ = import_cupy_nccl()  # NotSupported with the install hint when CuPy is missing
    return cupy.ascontiguousarray(x).ravel()


def empty_for(buf: Buf, n: int):
    """A new flat buffer of n elements of buf's dtype, on buf's device."""
    if buf.kind != "cuda":
        return np.empty(n, dtype=numpy_of_dtype(buf.dtype))
    if _is_torch(buf.flat):
        return buf.flat.new_empty(n)
    import cupy

    with cupy.cuda.Device(buf.flat.device.id):  # buf's device, whichever is current here
        return cupy.empty(n, dtype=buf.flat.dtype)


_TORCH_DTYPES: dict = {}  # torch dtype -> DType (found through an empty CPU tensor, once)


def _cuda_dtype(x) -> DType:
    if _is_torch(x):
        dt = _TORCH_DTYPES.get(x.dtype)
        if dt is None:
            import torch

            dt = DType.BFLOAT16 if x.dtype == torch.bfloat16 else \
                dtype_of_numpy(torch.empty(0, dtype=x.dtype).numpy().dtype)
            _TORCH_DTYPES[x.dtype] = dt
        return dt
    return dtype_of_numpy(np.dtype(x.dtype))


def _bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    return (u16.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(f32: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(f32, dtype=np.float32).view(np.uint32)
    rounding = ((u >> 16) & 1) + np.uint32(0x7FFF)
    out = ((u + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(f32)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def scale_(flat, dtype: DType, factor: float) -> None:
    """flat *= factor in place, in the buffer's own precision (bf16 via float32)."""
    if factor == 1.0:
        return
    if not isinstance(flat, np.ndarray):  # a CUDA tensor or CuPy array: scale on the device
        if hasattr(flat, "mul_"):
            flat.mul_(factor)
        else:
            flat *= factor
        return
    if flat.size == 0:
        return
    if dtype == DType.BFLOAT16:
        flat[...] = _f32_to_bf16(_bf16_to_f32(flat) * np.float32(factor))
    else:
        np.multiply(flat, flat.dtype.type(factor), out=flat)


def describe_tensor(name: str | None, buf: Buf) -> str:
    dims = ",".join(str(d) for d in buf.shape)
    label = f"'{name}' " if name else ""
    return f"{label}{buf.dtype.name.lower()}[{dims}]"


