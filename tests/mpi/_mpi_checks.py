"""Run under mpiexec: every MpiBackend op x dtype x count, checked against numpy.

Every rank can generate every rank's input (`_data(rank, ...)` is seeded by
the rank), so each rank computes the expected result locally and compares
bit for bit.  Inputs are small integers, so sums and products are exact in
every dtype and any reduction order; rounding is checked separately with
hand-made halfway cases whose answers are written out as bit patterns.

Prints "MPI CHECKS OK <n>" and exits 0, or prints every failure and exits 1.
tests/mpi/_mpi_world.py runs these and the front-end checks in one launch.
"""
from __future__ import annotations

import os
import sys
import traceback

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from collectives.backends._mpi_types import bf16_to_f32  # noqa: E402
from collectives.backends.mpi import MpiBackend  # noqa: E402
from collectives.errors import CollectiveError  # noqa: E402
from collectives.types import DType, ReduceOp, numpy_of_dtype  # noqa: E402

COUNTS = (0, 1, 7, 65537)
OPS = (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT)


def _data(rank: int, dtype: DType, n: int, tag: int, op: ReduceOp = ReduceOp.SUM) -> np.ndarray:
    """Rank `rank`'s input: small integers, exact in every dtype."""
    rng = np.random.default_rng([rank, int(dtype), n, tag, int(op)])
    if dtype == DType.BOOL:
        # "all" ops need mostly-true inputs to be interesting.
        p = 0.9 if op in (ReduceOp.MIN, ReduceOp.PRODUCT) else 0.2
        return rng.random(n) < p
    if op == ReduceOp.PRODUCT:
        vals = rng.choice(np.array([-2, -1, 1, 2]), n)
    else:
        vals = rng.integers(-4, 5, n)
    if dtype == DType.UINT8:
        vals = np.abs(vals)
    if dtype == DType.BFLOAT16:
        return (vals.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return vals.astype(numpy_of_dtype(dtype))


def _as_values(dtype: DType, a: np.ndarray) -> np.ndarray:
    return bf16_to_f32(a) if dtype == DType.BFLOAT16 else a


def _reference(dtype: DType, op: ReduceOp, inputs: list) -> np.ndarray:
    vals = [_as_values(dtype, a) for a in inputs]
    if dtype == DType.BOOL:
        fold = np.logical_or if op in (ReduceOp.SUM, ReduceOp.MAX) else np.logical_and
    else:
        fold = {ReduceOp.SUM: np.add, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum,
                ReduceOp.PRODUCT: np.multiply}[op]
    out = vals[0].copy()
    for v in vals[1:]:
        out = fold(out, v)
    if dtype == DType.BFLOAT16:  # exact values: truncation is the exact conversion
        return (out.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return out.astype(inputs[0].dtype)


class Checker:
    def __init__(self, backend: MpiBackend) -> None:
        self.b = backend
        self.rank, self.size = backend.rank, backend.size
        self.failures: list = []
        self.count = 0

    def expect(self, what: str, got: np.ndarray, want: np.ndarray) -> None:
        self.count += 1
        if got.shape != want.shape or got.tobytes() != want.tobytes():
            bad = np.flatnonzero(got != want)[:5] if got.shape == want.shape else "shape"
            self.failures.append(f"rank {self.rank}/{self.size} {what}: got {got[:8]!r} want "
                                 f"{want[:8]!r} (first bad index {bad})")

    def allreduce(self, dtype: DType, op: ReduceOp, n: int) -> None:
        inputs = [_data(r, dtype, n, 1, op) for r in range(self.size)]
        want = _reference(dtype, op, inputs)
        src = inputs[self.rank].copy()
        dst = np.full_like(src, 3)
        self.b.allreduce(src, dst, dtype, op)
        self.expect(f"allreduce {op.name} {dtype.name}[{n}]", dst, want)
        self.expect(f"allreduce {op.name} {dtype.name}[{n}] leaves src", src, inputs[self.rank])
        buf = inputs[self.rank].copy()
        self.b.allreduce(buf, buf, dtype, op)
        self.expect(f"in-place allreduce {op.name} {dtype.name}[{n}]", buf, want)

    def allgather(self, dtype: DType, n: int) -> None:
        for counts in ([n] * self.size, [n + r for r in range(self.size)],
                       [0 if r == 0 else n for r in range(self.size)]):
            inputs = [_data(r, dtype, counts[r], 2) for r in range(self.size)]
            dst = np.empty(sum(counts), dtype=inputs[0].dtype)
            self.b.allgather(inputs[self.rank], dst, dtype, counts)
            self.expect(f"allgather {dtype.name} counts={counts}", dst, np.concatenate(inputs))

    def broadcast(self, dtype: DType, n: int) -> None:
        for root in range(self.size):
            want = _data(root, dtype, n, 3)
            buf = want.copy() if self.rank == root else np.zeros_like(want)
            self.b.broadcast(buf, dtype, root)
            self.expect(f"broadcast {dtype.name}[{n}] root={root}", buf, want)

    def reducescatter(self, dtype: DType, op: ReduceOp, n: int) -> None:
        for counts in ([n] * self.size, [n + 2 * r for r in range(self.size)]):
            inputs = [_data(r, dtype, sum(counts), 4, op) for r in range(self.size)]
            full = _reference(dtype, op, inputs)
            lo = sum(counts[:self.rank])
            dst = np.empty(counts[self.rank], dtype=inputs[0].dtype)
            self.b.reducescatter(inputs[self.rank], dst, dtype, op, counts)
            self.expect(f"reducescatter {op.name} {dtype.name} counts={counts}", dst,
                        full[lo:lo + counts[self.rank]])

    def alltoall(self, dtype: DType, n: int) -> None:
        def split(i: int, j: int) -> int:
            return n + (i + 2 * j) % 3 if n else (i + j) % 2

        def blocks(i: int) -> list:
            data = _data(i, dtype, sum(split(i, j) for j in range(self.size)), 5)
            edges = np.cumsum([0] + [split(i, j) for j in range(self.size)])
            return [data[edges[j]:edges[j + 1]] for j in range(self.size)]

        me = self.rank
        send = np.concatenate(blocks(me))
        want = np.concatenate([blocks(i)[me] for i in range(self.size)])
        dst = np.empty_like(want)
        self.b.alltoall(send, [split(me, j) for j in range(self.size)], dst,
                        [split(i, me) for i in range(self.size)], dtype)
        self.expect(f"alltoall {dtype.name} base={n}", dst, want)


def check_rounding(c: Checker) -> None:
    """Halfway sums round to nearest even, in float16 and bfloat16."""
    b = c.b
    # bf16 bit patterns: 1.0 = 0x3F80, ulp 2^-7; 2^-8 = 0x3B80 (half an ulp of 1.0).
    mine = {0: [0x3F80, 0x3F81, 0x3F80], 1: [0x3B80, 0x3B80, 0x3C00]}
    got = np.array(mine.get(c.rank, [0, 0, 0]), dtype=np.uint16)
    b.allreduce(got, got, DType.BFLOAT16, ReduceOp.SUM)
    # 1 + 2^-8 -> 1 (tie to even), (1 + 2^-7) + 2^-8 -> 1 + 2^-6 (tie to even),
    # 1 + 2^-7 exactly -> 0x3F81
    want = np.array([0x3F80, 0x3F82, 0x3F81], dtype=np.uint16) if c.size > 1 else \
        np.array([0x3F80, 0x3F81, 0x3F80], dtype=np.uint16)
    c.expect("bf16 round-to-nearest-even", got, want)
    h = np.array({0: [1.0, 1.0 + 2**-10], 1: [2**-11, 2**-11]}.get(c.rank, [0, 0]), dtype=np.float16)
    b.allreduce(h, h, DType.FLOAT16, ReduceOp.SUM)
    want_h = np.array([1.0, 1.0 + 2**-9], dtype=np.float16) if c.size > 1 else \
        np.array([1.0, 1.0 + 2**-10], dtype=np.float16)
    c.expect("f16 round-to-nearest-even", h, want_h)


def check_errors(c: Checker) -> None:
    """An MPI error becomes a CollectiveError naming the rank and the op."""
    buf = np.zeros(4, dtype=np.float32)
    try:
        c.b.broadcast(buf, DType.FLOAT32, root=c.size + 5)
    except CollectiveError as exc:
        text = str(exc)
        c.count += 1
        for part in ("broadcast #", f"on rank {c.rank}/{c.size}", "MPI error", "root"):
            if part not in text:
                c.failures.append(f"error text lacks {part!r}: {text}")
    else:
        c.failures.append("broadcast to a root outside the world did not raise")


def check_topology(c: Checker) -> None:
    t = c.b.topology
    c.count += 1
    if len(set(t.hosts)) != 1 or t.local_size != c.size or t.local_rank != c.rank or t.cross_size != 1:
        c.failures.append(f"one machine should be one host: {t}")


def run_backend_checks() -> int:
    """Every backend-level check on a fresh MpiBackend; prints OK or every failure; 0 or 1."""
    backend = MpiBackend.from_world()
    c = Checker(backend)
    try:
        check_topology(c)
        for dtype in DType:
            for n in COUNTS:
                for op in OPS:
                    c.allreduce(dtype, op, n)
                    c.reducescatter(dtype, op, min(n, 4099))
                c.allgather(dtype, n)
                c.broadcast(dtype, n)
                c.alltoall(dtype, n)
        c.allreduce(DType.FLOAT32, ReduceOp.SUM, 3_000_001)  # past MPI's pipelining thresholds
        c.allreduce(DType.BFLOAT16, ReduceOp.SUM, 1_000_003)
        check_rounding(c)
        check_errors(c)
        backend.barrier()
    except Exception:  # noqa: BLE001 - report and fail, don't hang the others silently
        c.failures.append(traceback.format_exc())
    finally:
        backend.close()
        backend.close()  # safe twice
    for f in c.failures:
        print("FAIL backend", f, flush=True)
    if not c.failures:
        print(f"MPI CHECKS OK {c.count} rank {c.rank}/{c.size}", flush=True)
    return 1 if c.failures else 0


if __name__ == "__main__":
    sys.exit(run_backend_checks())
