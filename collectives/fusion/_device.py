"""Device fusion buffers: the few operations torch CUDA tensors and CuPy arrays spell differently.

Slicing, `a[...] = b` and `a *= f` are the same in both frameworks; allocation,
concatenation into a given buffer and cloning are not.  CuPy's spelling is
numpy's, so the functions also take CPU torch tensors and numpy arrays: that is
how the tests run the device packing on machines without a GPU.
"""
from __future__ import annotations

import sys

__all__ = ["is_torch", "empty_like", "concat", "clone"]


def is_torch(x) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _xp(x):
    """numpy for numpy arrays, else CuPy (whose arrays these are)."""
    import numpy

    if isinstance(x, numpy.ndarray):
        return numpy
    import cupy

    return cupy


def empty_like(like, n: int):
    if is_torch(like):
        return like.new_empty(n)
    return _xp(like).empty(n, dtype=like.dtype)


def concat(flats: list, out) -> None:
    if is_torch(out):
        import torch

        torch.cat(flats, out=out)
    else:
        _xp(out).concatenate(flats, out=out)


def clone(x):
    return x.clone() if is_torch(x) else x.copy()
