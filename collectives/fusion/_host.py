"""Host fusion buffers: packing numpy tensors in and out, bfloat16 widened to float32.

A fusion buffer holds bfloat16 as float32 (the communicator's numpy path has
no bfloat16): `pack` widens while copying in (a bfloat16 is the top half of
a float32) and applies the prescale factor; `narrow_bf16` rounds back to
nearest even, NaNs kept NaN, on the way out.  `movable` gives the view a
collective that only moves bytes takes.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..types import DType
from .request import Request, Signature

__all__ = ["BF16", "movable", "scale", "pack", "narrow_bf16"]

BF16 = int(DType.BFLOAT16)


def movable(flat: np.ndarray, dtype: int) -> np.ndarray:
    """A view the communicator can move without reducing (bfloat16 travels as int16)."""
    return flat.view(np.int16) if dtype == BF16 else flat


def scale(x: np.ndarray, factor: float) -> None:
    if factor != 1.0:
        np.multiply(x, np.float32(factor) if x.dtype == np.float16 else factor, out=x,
                    casting="unsafe")


def pack(dst: np.ndarray, req: Optional[Request], sig: Signature) -> None:
    if req is None:
        dst.fill(0)
        return
    src = req.buf.flat
    if sig.dtype == BF16:
        u = dst.view(np.uint32)
        u[...] = src
        np.left_shift(u, 16, out=u)
    else:
        np.copyto(dst, src)
    scale(dst, sig.prescale)


def narrow_bf16(src: np.ndarray, out: np.ndarray) -> None:
    u = src.view(np.uint32)
    nan = np.isnan(src)
    u += ((u >> 16) & 1) + np.uint32(0x7FFF)
    np.right_shift(u, 16, out=u)
    out[...] = u
    if nan.any():
        out[nan] = 0x7FC0
