"""Our MPI backend through the Communicator vs raw mpi4py Allreduce.

    python benchmarks/mpi_backend.py            # launches itself: mpiexec -n 2
    python benchmarks/mpi_backend.py --np 3 --min 4K --max 64M --iters 20

Three sides allreduce (SUM) the same float32 buffers out of place, on the
same ranks, in one run: raw is `MPI.COMM_WORLD.Dup().Allreduce(src, dst)`;
backend is `MpiBackend.allreduce` called directly (lock, op lookup, error
translation); ours is `Communicator(MpiBackend.from_world()).allreduce(src,
out=dst)`, the path users take (validation, sequence numbers included).  They
take turns rep by rep, rotating which goes first, so machine noise hits all
alike; the time is the median over reps of the mean over `iters` calls.  algbw = bytes / time, busbw =
algbw * 2(n-1)/n (nccl-tests); the table is benchmarks/_table.py's, whose
ratios are busbw a / busbw b.  The target: ours within 10% of raw at >= 4 MiB.
Results also go to benchmarks/results/mpi_backend-<time>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path[:0] = [REPO, os.path.dirname(os.path.abspath(__file__))]

from _table import parse_size  # noqa: E402


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=2, help="ranks to launch (default 2)")
    p.add_argument("--min", type=parse_size, default=4 << 10, help="smallest buffer, bytes (4K)")
    p.add_argument("--max", type=parse_size, default=64 << 20, help="largest buffer, bytes (64M)")
    p.add_argument("--iters", type=int, default=0, help="calls per rep (0: by size)")
    p.add_argument("--reps", type=int, default=9, help="reps per side per size")
    p.add_argument("--json", default="", help="path of the JSON (default: benchmarks/results/mpi_backend-<time>.json)")
    return p.parse_args(argv)


def _launch(args: argparse.Namespace) -> int:
    """Driver: run this file under mpiexec (no MPI in the driver process)."""
    cmd = ["mpiexec", "-n", str(args.np), sys.executable, os.path.abspath(__file__), *sys.argv[1:]]
    print("+", " ".join(cmd), flush=True)
    return subprocess.call(cmd)


def _time(fn, iters: int, barrier) -> float:
    barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


SIDES = ("raw", "backend", "ours")


def _measure(comm, raw, MPI, nbytes: int, args) -> dict:
    from collectives.types import DType, ReduceOp

    n = nbytes // 4
    src = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
    outs = {side: np.empty_like(src) for side in SIDES}
    iters = args.iters or max(3, min(200, (64 << 20) // max(nbytes, 1) // 4))
    run = {
        "raw": lambda: raw.Allreduce(src, outs["raw"], MPI.SUM),
        "backend": lambda: comm.backend.allreduce(src, outs["backend"], DType.FLOAT32, ReduceOp.SUM),
        "ours": lambda: comm.allreduce(src, out=outs["ours"]),
    }
    for fn in run.values():  # warm up
        fn()
    times: dict = {side: [] for side in SIDES}
    for rep in range(args.reps):  # rotate which side goes first
        for side in SIDES[rep % 3:] + SIDES[:rep % 3]:
            times[side].append(_time(run[side], iters, raw.Barrier))
    for side in SIDES:
        assert np.array_equal(outs[side], outs["raw"]), f"{side} result differs from raw mpi4py"
    # Every rank must report the same number: take the slowest rank's median.
    med = np.array([statistics.median(times[side]) for side in SIDES])
    raw.Allreduce(MPI.IN_PLACE, med, MPI.MAX)
    return {"size": nbytes, "count": n, "dtype": "float32", "iters": iters,
            "results": {side: {"time_us": float(t) * 1e6} for side, t in zip(SIDES, med)}}


def _child(args: argparse.Namespace) -> int:
    from mpi4py import MPI

    from collectives.backends.mpi import MpiBackend
    from collectives.communicator import Communicator

    backend = MpiBackend.from_world()
    comm = Communicator(backend)
    raw = MPI.COMM_WORLD.Dup()
    rows, nbytes = [], args.min
    while nbytes <= args.max:
        rows.append(_measure(comm, raw, MPI, nbytes, args))
        nbytes *= 4
    if comm.rank == 0:
        import _table

        _table.complete(rows, "allreduce", comm.size)
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        print(_table.format_table(
            rows, SIDES, ratios=(("backend", "raw"), ("ours", "raw")),
            title=f"allreduce SUM float32 out of place, {comm.size} ranks, "
                  f"{MPI.Get_library_version().splitlines()[0].strip()}, load average {load}; "
                  "target: ours/raw >= 0.91 (within 10%) at >= 4 MiB"))
        path = args.json or _table.write_json("mpi_backend", {"ranks": comm.size, "rows": rows})
        if args.json:
            with open(path, "w") as f:
                json.dump({"ranks": comm.size, "rows": rows}, f, indent=1)
        print(f"# wrote {path}")
    comm.close()
    raw.Free()
    return 0


def main() -> int:
    from collectives.backends.mpi import launched_by_mpiexec

    args = _args()
    return _child(args) if launched_by_mpiexec(os.environ) else _launch(args)


if __name__ == "__main__":
    sys.exit(main())
