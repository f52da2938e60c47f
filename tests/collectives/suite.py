"""The collective suite every backend runs: `check_all(comm)` on every rank.

Backend-agnostic: it takes a `collectives.Communicator` (native over shm or
TCP, MPI under mpiexec, ...) and checks every op x dtype x count against
numpy, in place and out of place, plus bit-identical results across ranks.
It raises AssertionError naming the op, dtype and count that went wrong.
Run all checks of one world inside one group of rank processes: starting
ranks is what costs time.

Inputs are small integers (also for floats), so every reduction order gives
the exact same answer and the comparison with numpy is exact; one check
with random floats compares with a tolerance and asserts that every rank
holds the same bits.
"""
from __future__ import annotations

import numpy as np

from collectives import DType, ReduceOp

FLOATS = ("float16", "bfloat16", "float32", "float64")
INTS = ("int8", "int16", "int32", "int64", "uint8")
DTYPES = FLOATS + INTS + ("bool",)
LARGE_BYTES = 400 * 1024  # several shm steps and TCP chunks, above the one-step path
HUGE_FLOATS = 1_200_007   # float32 only: several 512 KiB TCP chunks per ring segment on 4 ranks


def counts_for(dtype: str, huge: bool = False) -> tuple:
    """0, 1, odd, large (in elements of this dtype); huge adds one for float32."""
    item = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
    extra = (HUGE_FLOATS,) if huge and dtype == "float32" else ()
    return (0, 1, 17, LARGE_BYTES // item + 3) + extra


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def values(rank: int, count: int, dtype: str, salt: int = 0) -> np.ndarray:
    """Rank `rank`'s input: small integers, as float64 (cast by `tensor`)."""
    i = np.arange(count, dtype=np.int64)
    v = (i * 7 + rank * 13 + salt * 5) % 11 - 5
    if dtype == "bool":
        return ((i + rank + salt) % 3 == 0).astype(np.float64)
    if dtype == "uint8":
        return np.abs(v).astype(np.float64)
    return v.astype(np.float64)


def tensor(v: np.ndarray, dtype: str):
    """The value as the caller's kind: numpy, or torch for bfloat16."""
    if dtype == "bfloat16":
        import torch

        return torch.tensor(v, dtype=torch.bfloat16)
    return v.astype(dtype)


def as_numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):
        return x.detach().float().numpy().astype(np.float64)
    return np.asarray(x)


def _reference(arrays, op: ReduceOp, dtype: str) -> np.ndarray:
    """The reduction numpy computes, in the dtype (float for bfloat16)."""
    np_dtype = "float32" if dtype == "bfloat16" else dtype
    xs = [a.astype(np_dtype) for a in arrays]
    if dtype == "bool":
        fold = {ReduceOp.SUM: np.logical_or, ReduceOp.MAX: np.logical_or,
                ReduceOp.MIN: np.logical_and, ReduceOp.PRODUCT: np.logical_and}[op]
    else:
        fold = {ReduceOp.SUM: np.add, ReduceOp.AVERAGE: np.add, ReduceOp.MIN: np.minimum,
                ReduceOp.MAX: np.maximum, ReduceOp.PRODUCT: np.multiply}[op]
    out = xs[0]
    with np.errstate(over="ignore"):
        for x in xs[1:]:
            out = fold(out, x).astype(np_dtype)
    if op == ReduceOp.AVERAGE:
        out = (out / len(xs)).astype(np_dtype)
    return out


def ops_for(dtype: str) -> tuple:
    ops = [ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT]
    if dtype in FLOATS:
        ops.append(ReduceOp.AVERAGE)
    return tuple(ops)


def _equal(got, want: np.ndarray, what: str, rtol: float = 0.0) -> None:
    g = as_numpy(got).astype(np.float64).ravel()
    w = np.asarray(want).astype(np.float64).ravel()
    assert g.shape == w.shape, f"{what}: shape {g.shape} != {w.shape}"
    if rtol:
        assert np.allclose(g, w, rtol=rtol, atol=rtol), f"{what}: not within {rtol} of numpy"
    elif not np.array_equal(g, w):
        bad = int(np.flatnonzero(g != w)[0])
        raise AssertionError(f"{what}: element {bad} is {g[bad]}, numpy says {w[bad]} "
                             f"({int((g != w).sum())} of {g.size} differ)")


def _product_inputs(rank: int, count: int, dtype: str) -> np.ndarray:
    """Inputs whose products over a few ranks stay exact in every dtype."""
    v = values(rank, count, dtype)
    if dtype == "bool":
        return v
    if dtype == "uint8":
        return v % 2 + 1
    return v % 3 - 1


_AVERAGE_TOL = {"float16": 1e-3, "bfloat16": 1e-2, "float32": 1e-6, "float64": 1e-12}


def check_allreduce(comm) -> None:
    """Every op on counts 0, 1 and odd; sum and min also on a large count, and in place."""
    n = comm.size
    for dtype in DTYPES:
        if dtype == "bfloat16" and not _has_torch():
            continue
        *small, large = counts_for(dtype)
        for op in ops_for(dtype):
            heavy = op in (ReduceOp.SUM, ReduceOp.MIN)
            for count in small + [large] * heavy:
                _check_allreduce_once(comm, dtype, count, op, in_place=heavy)


def _check_allreduce_once(comm, dtype: str, count: int, op: ReduceOp, in_place: bool) -> None:
    n = comm.size
    make = _product_inputs if op == ReduceOp.PRODUCT else values
    want = _reference([make(q, count, dtype) for q in range(n)], op, dtype)
    what = f"allreduce {op.name.lower()} {dtype}[{count}] size {n}"
    # average divides after the sum; numpy may round the quotient otherwise
    tol = _AVERAGE_TOL[dtype] if op == ReduceOp.AVERAGE else 0.0
    got = comm.allreduce(tensor(make(comm.rank, count, dtype), dtype), op=op)
    _equal(got, want, what, tol)
    if in_place:
        x = tensor(make(comm.rank, count, dtype), dtype)
        got = comm.allreduce(x, out=x, op=op)
        _equal(x, want, what + " in place", tol)
        _equal(got, want, what + " in place (returned)", tol)


def check_scaling_and_async(comm) -> None:
    n = comm.size
    x = np.arange(1000, dtype=np.float32)
    got = comm.allreduce(x, prescale=2.0, postscale=0.25)
    _equal(got, x * 2.0 * n * 0.25, "allreduce with prescale 2, postscale 0.25")
    works = [comm.allreduce(np.full(33, i, np.int64), async_op=True) for i in range(6)]
    for i, w in enumerate(works):
        _equal(w.wait(timeout=60), np.full(33, i * n), f"async allreduce #{i}")


def check_bit_identical(comm) -> None:
    """Random floats: close to numpy, and the same bits on every rank."""
    n = comm.size
    for dtype in ("float16", "float32", "float64"):
        for count in (5, 40_001, 300_001):
            inputs = [np.random.default_rng(q * 1000 + count).standard_normal(count).astype(dtype)
                      for q in range(n)]
            got = comm.allreduce(inputs[comm.rank])
            want = _reference(inputs, ReduceOp.SUM, dtype)
            tol = {"float16": 2e-2, "float32": 1e-5, "float64": 1e-12}[dtype]
            assert np.allclose(got, want, rtol=tol, atol=tol * n), f"allreduce sum {dtype}[{count}] random"
            everyone = comm.allgather(np.ascontiguousarray(got).view(np.uint8))
            mine = np.ascontiguousarray(got).view(np.uint8)
            for q in range(n):
                assert np.array_equal(everyone[q * mine.size:(q + 1) * mine.size], mine), \
                    f"allreduce {dtype}[{count}]: rank {q} holds other bits than rank {comm.rank}"


def check_allgather(comm) -> None:
    n = comm.size
    for dtype in DTYPES:
        if dtype == "bfloat16" and not _has_torch():
            continue
        for count in counts_for(dtype):
            rows = [(count + q) // (q + 1) for q in range(n)]  # a different first dim per rank
            mine = values(comm.rank, rows[comm.rank] * 3, dtype).reshape(rows[comm.rank], 3)
            got = comm.allgather(tensor(mine, dtype))
            want = np.concatenate([values(q, rows[q] * 3, dtype).reshape(rows[q], 3) for q in range(n)])
            assert tuple(got.shape) == want.shape, f"allgather {dtype}: shape {tuple(got.shape)}"
            _equal(got, want, f"allgather {dtype} rows {rows}")


def check_broadcast(comm) -> None:
    n = comm.size
    for dtype in DTYPES:
        if dtype == "bfloat16" and not _has_torch():
            continue
        for count in counts_for(dtype, huge=True):
            for root in sorted({0, n - 1}):
                buf = tensor(values(comm.rank, count, dtype), dtype)
                got = comm.broadcast(buf, root=root)
                assert got is buf, "broadcast returns its buffer"
                _equal(buf, values(root, count, dtype), f"broadcast {dtype}[{count}] from {root}")


def check_reducescatter(comm) -> None:
    """Sum with the default and an uneven split (ranks with no rows), max with the default."""
    n = comm.size
    for dtype in DTYPES:
        if dtype == "bfloat16" and not _has_torch():
            continue
        for count in counts_for(dtype, huge=True):
            uneven = [count] if n == 1 else [count - count // 2] + [0] * (n - 2) + [count // 2]
            inputs = [values(q, count, dtype) for q in range(n)]
            for op, split in ((ReduceOp.SUM, None), (ReduceOp.SUM, uneven), (ReduceOp.MAX, None)):
                total = _reference(inputs, op, dtype)
                rows = split or [count // n + (1 if q < count % n else 0) for q in range(n)]
                start = sum(rows[:comm.rank])
                got = comm.reducescatter(tensor(inputs[comm.rank], dtype), op=op, counts=split)
                _equal(got, total[start:start + rows[comm.rank]],
                       f"reducescatter {op.name.lower()} {dtype}[{count}] counts {rows}")


def check_alltoall(comm) -> None:
    """Uneven splits (some empty); every dtype, and a large exchange for a few."""
    n, r = comm.size, comm.rank
    for dtype in DTYPES:
        if dtype == "bfloat16" and not _has_torch():
            continue
        large = (LARGE_BYTES // 8,) if dtype in ("float32", "int8", "bfloat16") else ()
        for scale in (0, 1, 5) + large:
            # rank q sends (q + j) % 3 * scale rows of 2 to rank j
            splits = [(r + j) % 3 * scale for j in range(n)]
            src = values(r, sum(splits) * 2, dtype).reshape(sum(splits), 2)
            got, recv = comm.alltoall(tensor(src, dtype), splits=splits)
            assert list(np.asarray(recv)) == [(q + r) % 3 * scale for q in range(n)], \
                f"alltoall received splits {list(recv)}"
            parts = []
            for q in range(n):
                q_splits = [(q + j) % 3 * scale for j in range(n)]
                q_src = values(q, sum(q_splits) * 2, dtype).reshape(sum(q_splits), 2)
                first = sum(q_splits[:r])
                parts.append(q_src[first:first + q_splits[r]])
            _equal(got, np.concatenate(parts), f"alltoall {dtype} scale {scale}")


_ADASUM_TOL = {"float16": 2e-3, "float32": 1e-6, "float64": 1e-12}


def _adasum_rows(n: int, count: int, dtype: str) -> np.ndarray:
    """Every rank's Adasum input: random floats, rank 1 a multiple of rank 0 (their pair
    averages), the last rank of four all zeros (its pair returns the other vector)."""
    rows = np.stack([np.random.default_rng(50 + r).standard_normal(count) for r in range(n)])
    if n > 1:
        rows[1] = 3.0 * rows[0]
    if n == 4:
        rows[3] = 0.0
    return rows.astype(dtype)


def check_adasum(comm) -> None:
    """Adasum (the backend's) equals collectives.adasum's tree of every rank's vector: whole
    vectors and packed segments; refused on a world that is not a power of two."""
    from collectives import NotSupported, adasum

    n, r = comm.size, comm.rank
    if n & (n - 1):
        try:
            comm.allreduce(np.ones(4, np.float32), op=ReduceOp.ADASUM)
        except NotSupported as exc:
            assert "power-of-two" in str(exc) and f"has {n}" in str(exc), str(exc)
            return
        raise AssertionError(f"Adasum ran on {n} ranks")
    for dtype in ("float16", "float32", "float64"):
        for count in (0, 1, 17, LARGE_BYTES // np.dtype(dtype).itemsize + 3):
            rows = _adasum_rows(n, count, dtype)
            got = comm.allreduce(rows[r].copy(), op=ReduceOp.ADASUM)
            _equal(got, adasum.tree(rows), f"adasum {dtype}[{count}]", rtol=_ADASUM_TOL[dtype])
            same = comm.allgather(np.asarray(got).reshape(1, -1))
            assert (same == same[0]).all(), f"adasum {dtype}[{count}]: ranks hold other bits"
    segments = [5, 0, 1, 40_000, 3, 70_001]  # tensors fused in one buffer
    rows = _adasum_rows(n, sum(segments), "float32")
    rows[:, 5:6] *= 1e3  # a segment whose scale would swamp its neighbours' dot products
    bounds = np.cumsum([0] + segments)
    buf = rows[r].copy()
    comm.backend.adasum(buf, DType.FLOAT32, segments)
    want = adasum.tree(rows, list(zip(bounds[:-1], bounds[1:])))
    _equal(buf, want, "adasum of packed segments", rtol=1e-6)


def check_barrier(comm) -> None:
    for _ in range(3):
        comm.barrier()


CHECKS = (check_allreduce, check_scaling_and_async, check_bit_identical, check_allgather,
          check_broadcast, check_reducescatter, check_alltoall, check_adasum, check_barrier)


def check_all(comm) -> int:
    """Run every check; returns how many ran (raises AssertionError on the first failure)."""
    for check in CHECKS:
        check(comm)
    return len(CHECKS)
