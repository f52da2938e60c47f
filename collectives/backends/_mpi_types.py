"""DType and ReduceOp mapped onto MPI datatypes and reduction ops.

Terms: a *storage type* is the MPI datatype a buffer travels as; a *kernel*
is a numpy function `kernel(inbuf, inoutbuf)` that MPI calls (through
`MPI.Op.Create`) to fold one partial result into another, in place in
`inoutbuf`.

MPI has no standard 16-bit float.  float16 and bfloat16 buffers travel as
`MPI.UINT16_T` storage and reduce through user-defined ops:

* float16: numpy's float16 arithmetic, which computes in float32 and rounds
  to nearest even.
* bfloat16: widen to float32 (exact: bf16 is the top half of a float32),
  compute, round back to nearest even; NaN stays a quiet NaN.

Rounding through float32 is a single correct rounding for sum and product:
float32 carries p' = 24 bits, at least 2p + 2 for both halves (p = 11 and 8),
so the double rounding is innocuous.

bool travels as `MPI.C_BOOL` and reduces with logical ops: SUM and MAX are
"any" (LOR), MIN and PRODUCT are "all" (LAND), as in torch.distributed.

MPI aborts the whole job when a user op raises, so kernels never raise: a
failure is recorded in `Kernels.failure` and the backend raises it as a
CollectiveError once the MPI call returns.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from ..types import DType, ReduceOp

__all__ = ["storage_type", "Kernels", "bf16_to_f32", "f32_to_bf16"]

_STORAGE = {
    DType.FLOAT16: "UINT16_T", DType.BFLOAT16: "UINT16_T",
    DType.FLOAT32: "FLOAT", DType.FLOAT64: "DOUBLE",
    DType.INT8: "INT8_T", DType.INT16: "INT16_T", DType.INT32: "INT32_T",
    DType.INT64: "INT64_T", DType.UINT8: "UINT8_T", DType.BOOL: "C_BOOL",
}

_BUILTIN = {ReduceOp.SUM: "SUM", ReduceOp.MIN: "MIN", ReduceOp.MAX: "MAX",
            ReduceOp.PRODUCT: "PROD"}
_LOGICAL = {ReduceOp.SUM: "LOR", ReduceOp.MAX: "LOR", ReduceOp.MIN: "LAND",
            ReduceOp.PRODUCT: "LAND"}
_UFUNC = {ReduceOp.SUM: np.add, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum,
          ReduceOp.PRODUCT: np.multiply}


def storage_type(MPI, dtype: DType):
    """The MPI datatype a buffer of `dtype` travels as."""
    return getattr(MPI, _STORAGE[DType(dtype)])


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bit patterns -> float32 values (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 values -> uint16 bfloat16 bit patterns, rounded to nearest even."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    # Adding 0x7FFF plus the lowest kept bit rounds half to even; a carry out of
    # the mantissa correctly bumps the exponent (up to inf).  Only NaNs could
    # overflow the uint32 sum, and they take the other branch.
    rounded = ((bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    quiet_nan = ((bits >> 16) | 0x0040).astype(np.uint16)
    return np.where(np.isnan(values), quiet_nan, rounded)


def _f16_kernel(ufunc) -> Callable:
    def kernel(inbuf, inoutbuf) -> None:
        a = np.frombuffer(inbuf, dtype=np.float16)
        b = np.frombuffer(inoutbuf, dtype=np.float16)
        ufunc(a, b, out=b)
    return kernel


def _bf16_kernel(ufunc) -> Callable:
    def kernel(inbuf, inoutbuf) -> None:
        a = bf16_to_f32(np.frombuffer(inbuf, dtype=np.uint16))
        b_bits = np.frombuffer(inoutbuf, dtype=np.uint16)
        b_bits[...] = f32_to_bf16(ufunc(a, bf16_to_f32(b_bits)))
    return kernel


class Kernels:
    """Lazily created MPI ops for one backend; `free()` before MPI finalizes."""

    def __init__(self, MPI) -> None:
        self._MPI = MPI
        self._ops: dict = {}
        self._created: list = []  # the user-defined ops, which need Op.Free
        self.failure: Optional[BaseException] = None

    def op(self, dtype: DType, op: ReduceOp):
        """The MPI.Op that reduces `dtype` with `op` (cached: this is on every call's path)."""
        try:
            return self._ops[(dtype, op)]
        except KeyError:
            pass
        key = (dtype, op)
        dtype, op = DType(dtype), ReduceOp(op)
        if op not in _UFUNC:
            raise ValueError(f"ReduceOp.{op.name} must be lowered by the front end "
                             "(AVERAGE is SUM plus a postscale)")
        if dtype == DType.BOOL:
            mpi_op = getattr(self._MPI, _LOGICAL[op])
        elif dtype not in (DType.FLOAT16, DType.BFLOAT16):
            mpi_op = getattr(self._MPI, _BUILTIN[op])
        else:
            make = _f16_kernel if dtype == DType.FLOAT16 else _bf16_kernel
            mpi_op = self._MPI.Op.Create(self._guard(make(_UFUNC[op])), commute=True)
            self._created.append(mpi_op)
        self._ops[key] = mpi_op
        return mpi_op

    def _guard(self, kernel: Callable) -> Callable:
        def call(inbuf, inoutbuf, datatype) -> None:
            try:
                with np.errstate(all="ignore"):
                    kernel(inbuf, inoutbuf)
            except BaseException as exc:  # noqa: BLE001 - MPI would abort the job
                if self.failure is None:
                    self.failure = exc
        return call

    def take_failure(self) -> Optional[BaseException]:
        exc, self.failure = self.failure, None
        return exc

    def free(self) -> None:
        for op in self._created:
            try:
                op.Free()
            except Exception:  # noqa: BLE001 - MPI may already be finalized
                pass
        self._created.clear()
        self._ops.clear()
