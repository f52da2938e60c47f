"""Reduce ops and dtypes shared by every layer.

The integer values are the codes the native library takes (its
`hvs::DType` and `hvs::ReduceOp`); keep the two in step.  bfloat16 has no numpy
dtype: a bfloat16 buffer travels as uint16 storage with `DType.BFLOAT16`.
"""
from __future__ import annotations

import enum

import numpy as np

__all__ = ["ReduceOp", "DType", "dtype_of_numpy", "numpy_of_dtype"]


class ReduceOp(enum.IntEnum):
    SUM = 0
    AVERAGE = 1  # sum, then a postscale of 1/size; never sent to native code
    MIN = 2
    MAX = 3
    PRODUCT = 4
    ADASUM = 5  # allreduce only: the adaptive sum of collectives.adasum, not an elementwise op


class DType(enum.IntEnum):
    FLOAT16 = 0
    BFLOAT16 = 1
    FLOAT32 = 2
    FLOAT64 = 3
    INT8 = 4
    INT16 = 5
    INT32 = 6
    INT64 = 7
    UINT8 = 8
    BOOL = 9

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def is_floating(self) -> bool:
        return self in _FLOATING


_FLOATING = frozenset((DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64))

_ITEMSIZE = {
    DType.FLOAT16: 2, DType.BFLOAT16: 2, DType.FLOAT32: 4, DType.FLOAT64: 8,
    DType.INT8: 1, DType.INT16: 2, DType.INT32: 4, DType.INT64: 8,
    DType.UINT8: 1, DType.BOOL: 1,
}

_FROM_NUMPY = {
    np.dtype(np.float16): DType.FLOAT16,
    np.dtype(np.float32): DType.FLOAT32,
    np.dtype(np.float64): DType.FLOAT64,
    np.dtype(np.int8): DType.INT8,
    np.dtype(np.int16): DType.INT16,
    np.dtype(np.int32): DType.INT32,
    np.dtype(np.int64): DType.INT64,
    np.dtype(np.uint8): DType.UINT8,
    np.dtype(np.bool_): DType.BOOL,
}

_TO_NUMPY = {v: k for k, v in _FROM_NUMPY.items()}
_TO_NUMPY[DType.BFLOAT16] = np.dtype(np.uint16)


def dtype_of_numpy(dt: np.dtype) -> DType:
    """Map a numpy dtype to a DType, or raise TypeError naming the supported ones."""
    try:
        return _FROM_NUMPY[np.dtype(dt)]
    except KeyError:
        names = ", ".join(sorted(str(k) for k in _FROM_NUMPY)) + ", bfloat16 (torch)"
        raise TypeError(f"unsupported dtype {np.dtype(dt)}; supported: {names}") from None


def numpy_of_dtype(dt: DType) -> np.dtype:
    """The numpy storage dtype of a DType (uint16 for bfloat16)."""
    return _TO_NUMPY[DType(dt)]
