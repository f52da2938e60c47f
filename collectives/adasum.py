"""Adasum: the adaptive sum of every rank's vector, combined pairwise in a fixed tree.

Terms.  Two vectors a and b *combine* into

    a' = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(a vector whose norm is zero keeps the coefficient 1 on its side, so combining
with zeros returns the other vector).  Parallel vectors give their average,
orthogonal ones their sum.  The *tree* is recursive doubling over a world of
2^k ranks: at *level* j (j = 0 .. k-1) the *groups* of 2^j ranks pair up, group
g with group g+1 for even g, and the pair combines the lower group's vector (a)
with the upper group's (b); after k levels one vector is left.  A *segment* is
one tensor (one layer) of a fused buffer: each segment combines on its own, so
its dot products never mix with another tensor's.

Arithmetic: the dot products, norms and coefficients are float64; each combined
vector is rounded to the tensor's dtype before the next level uses it, as a
pair's result is stored before it travels on.

How it travels: every rank's vector is allgathered through the fusion engine
(one named op per tensor, negotiated and fused as any other), and every rank
runs the same tree on the same rows, so every rank holds the same result, bit
for bit.  Each rank receives (n-1) vectors, where a vector-halving exchange of
the same tree moves about 2; for the CPU worlds this serves (a few ranks) one
negotiated round costs less than log2(n) dependent ones.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np

from .errors import NotSupported
from .types import DType

__all__ = ["ADASUM", "is_adasum", "check_world", "check_dtype", "combine", "tree"]

FLOATING = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
NATIVE_DTYPES = (DType.FLOAT16, DType.FLOAT32, DType.FLOAT64)  # what a backend's adasum takes


def check_world(size: int, rank: int, what: str) -> None:
    """Adasum's tree needs a power-of-two world (as Horovod's CPU Adasum does)."""
    if size < 1 or size & (size - 1):
        raise NotSupported(f"{what}: Adasum needs a power-of-two number of ranks "
                           f"(1, 2, 4, 8, ...), this world has {size} (rank {rank}/{size}); "
                           f"run on {1 << (size.bit_length() - 1)} or "
                           f"{1 << size.bit_length()} ranks, or use op=Average")


def check_dtype(dtype, what: str) -> None:
    if np.dtype(dtype) not in FLOATING:
        raise TypeError(f"{what}: Adasum combines floating tensors (float16, float32, "
                        f"float64), got {np.dtype(dtype)}")


def combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The adaptive sum of two 1-d vectors of one dtype, in that dtype."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    dot = float(np.dot(a64, b64))
    ca, cb = _coefficient(dot, a64), _coefficient(dot, b64)
    a64 *= ca  # in place: the same values as ca * a64 + cb * b64, without three temporaries
    b64 *= cb
    a64 += b64
    return a64.astype(a.dtype)


def _coefficient(dot: float, v: np.ndarray) -> float:
    norm2 = float(np.dot(v, v))
    return 1.0 - dot / (2.0 * norm2) if norm2 > 0.0 else 1.0


def tree(rows: np.ndarray, segments: Optional[Sequence[Tuple[int, int]]] = None) -> np.ndarray:
    """The tree's result for `rows` (one row per rank, in rank order; 2^k rows).

    Args:
        segments: (start, stop) column ranges combined separately; default: the whole row.
    Returns:
        One row; columns outside every segment are left as zeros.
    """
    n, width = rows.shape
    if n & (n - 1):
        raise ValueError(f"Adasum tree: {n} rows is not a power of two")
    segments = [(0, width)] if segments is None else segments
    out = np.zeros(width, rows.dtype)
    for start, stop in segments:
        level = [np.ascontiguousarray(rows[r, start:stop]) for r in range(n)]
        while len(level) > 1:
            level = [combine(level[i], level[i + 1]) for i in range(0, len(level), 2)]
        out[start:stop] = level[0]
    return out


class _AdasumOp:
    """The value of `op=hvd.Adasum`: not a ReduceOp, since no backend reduces with it;
    the adapters see it and run the tree above."""

    name = "ADASUM"

    def __repr__(self) -> str:
        return "Adasum"

    def __reduce__(self) -> str:
        return "ADASUM"  # unpickles as the one instance


ADASUM = _AdasumOp()


def is_adasum(op) -> bool:
    """`op` asks for Adasum: the value, or Horovod's name for it in any case."""
    return op is ADASUM or (isinstance(op, str) and op.lower() == "adasum")
