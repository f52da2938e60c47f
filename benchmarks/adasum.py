"""Adasum against Average, in one run: the native vector-halving, distance-doubling
Adasum (native/src/adasum.cc), the allgather-and-tree Adasum it replaced (still every
other backend's: `Backend.adasum`), and an AVERAGE allreduce of the same buffer.

    python benchmarks/adasum.py                       # 2 ranks, one host, 1 .. 64 MiB float32
    python benchmarks/adasum.py --np 4
    python benchmarks/adasum.py --np 4 --hosts a,a,b,b # two fake hosts: shm within, TCP between
    python benchmarks/adasum.py --tcp                  # every rank a host of its own

Each size: every variant warms up, then times `iters` in-place calls `reps` times, best
run, slowest rank; variants take turns inside each repetition, so a busy moment of the
machine falls on all of them.  Ranks run with one BLAS thread each.  busbw uses allreduce's bus factor for all three (Adasum
moves what an allreduce moves).  Ratios are busbw ratios against Average (below 1:
slower).  JSON goes to benchmarks/results/.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _table import complete, format_table, size_range, write_json  # noqa: E402

VARIANTS = ("average", "adasum", "gather_tree")


def _rank(sizes, reps, budget):
    import numpy as np

    import collectives
    from collectives import DType, ReduceOp
    from collectives.backends.base import Backend

    comm = collectives.init()
    rng = np.random.default_rng(comm.rank)
    try:
        def run(variant, x):
            if variant == "average":
                comm.allreduce(x, out=x, op=ReduceOp.AVERAGE)
            elif variant == "adasum":
                comm.allreduce(x, out=x, op=ReduceOp.ADASUM)
            else:  # the generic path: allgather every vector, the numpy tree on each rank
                Backend.adasum(comm.backend, x, DType.FLOAT32, [x.size])

        out = {v: {} for v in VARIANTS}
        for nbytes in sizes:
            x = rng.standard_normal(nbytes // 4).astype(np.float32)
            iters = int(max(3, min(500, budget * 1e9 / max(nbytes, 1) / 4)))
            best = {v: float("inf") for v in VARIANTS}
            for v in VARIANTS:
                run(v, x)
            for _ in range(reps):
                for v in VARIANTS:
                    its = max(1, iters // 4) if v == "gather_tree" else iters
                    comm.barrier()
                    t = time.perf_counter()
                    for _ in range(its):
                        run(v, x)
                    best[v] = min(best[v], (time.perf_counter() - t) / its)
            for v in VARIANTS:
                out[v][nbytes] = best[v] * 1e6
        return {"times": out, "hosts": comm.cross_size, "local": comm.local_size,
                "cma": comm.backend.cma}
    finally:
        comm.close()


def main() -> None:
    from collectives.launch import run_local

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--min", default="1M")
    ap.add_argument("--max", default="64M")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget", type=float, default=0.2, help="seconds of ops per size, variant and rep")
    ap.add_argument("--hosts", default="", help="fake host of each rank, e.g. a,a,b,b")
    ap.add_argument("--tcp", action="store_true", help="every rank a host of its own")
    args = ap.parse_args()
    sizes = size_range(args.min, args.max, 4)
    hosts = args.hosts.split(",") if args.hosts else None
    # one BLAS thread a rank: numpy's dot products in the gather-and-tree variant would
    # otherwise leave BLAS threads spinning on the cores the next variant's ranks need
    env = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if args.tcp:
        env["HOROVOD_SPARK_FORCE_TCP"] = "1"
    results = run_local(_rank, args.np, args=(sizes, args.reps, args.budget), env=env,
                        hosts=hosts, timeout=1800)
    rows = [{"size": s, "count": s // 4, "dtype": "float32",
             "results": {v: {"time_us": max(r["times"][v][s] for r in results)}
                         for v in VARIANTS}} for s in sizes]
    complete(rows, "allreduce", args.np)
    where = (f"{results[0]['hosts']} hosts x {results[0]['local']} ranks"
             + (f", shm cma {results[0]['cma']}" if results[0]["local"] > 1 else ""))
    print(format_table(rows, VARIANTS, [("adasum", "average"), ("gather_tree", "average"),
                                        ("adasum", "gather_tree")],
                       title=f"Adasum and Average, {args.np} ranks ({where}), best of {args.reps}"))
    print(write_json("adasum", {"np": args.np, "hosts": hosts, "tcp": args.tcp, "rows": rows}))


if __name__ == "__main__":
    main()
