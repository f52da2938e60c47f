"""What the native mesh's frame tags cost (HOROVOD_SPARK_MESH_INTEGRITY): allreduce over
TCP with nothing tagged ("off"), the default ("control": op headers, notices and the
job's coordination ops), and every payload tagged ("payload"), in one run.

    python benchmarks/mesh_integrity.py                   # 2 ranks, 4 KiB .. 64 MiB float32
    python benchmarks/mesh_integrity.py --np 3 --rounds 3 --max 16M
    python benchmarks/mesh_integrity.py --baseline /tmp/before   # + "payload" of that checkout

Each rank is a host of its own (HOROVOD_SPARK_FORCE_TCP=1), so every byte crosses TCP
(loopback here: the link is fast, which makes the tags' share of the time the largest it
gets; across hosts the network takes a bigger share).  A round starts one group of rank
processes per mode, in turn; per size each group warms up, then times `iters` in-place
`comm.allreduce` calls `reps` times, best run, slowest rank.  The table takes each mode's
best over the rounds; ratios are busbw ratios against "off" (below 1: slower).  JSON goes
to benchmarks/results/.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
REPO = os.path.dirname(HERE)

from _table import complete, format_table, size_range, write_json  # noqa: E402

MODES = ("off", "control", "payload")


def _rank(sizes, reps, budget):
    import numpy as np

    import collectives

    comm = collectives.init()
    try:
        out = {}
        for nbytes in sizes:
            x = np.ones(nbytes // 4, np.float32)
            iters = int(max(5, min(2000, budget * 1e9 / max(nbytes, 1) / 4)))
            for _ in range(3):
                comm.allreduce(x, out=x)
            best = float("inf")
            for _ in range(reps):
                comm.barrier()
                t = time.perf_counter()
                for _ in range(iters):
                    comm.allreduce(x, out=x)
                best = min(best, (time.perf_counter() - t) / iters)
            out[nbytes] = best * 1e6
        return {"times": out, "integrity": comm.backend._mesh.integrity,
                "from": os.path.dirname(os.path.dirname(os.path.abspath(collectives.__file__)))}
    finally:
        comm.close()


def main() -> None:
    from collectives.launch import run_local

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--min", default="4K")
    ap.add_argument("--max", default="64M")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget", type=float, default=0.3, help="seconds of ops per size and run")
    ap.add_argument("--baseline", help="a checkout (built in place) whose ranks run 'payload' "
                                       "too, as the column 'payload-base': another build, one run")
    args = ap.parse_args()
    sizes = size_range(args.min, args.max, 4)
    modes = MODES + (("payload-base",) if args.baseline else ())
    best = {m: {s: float("inf") for s in sizes} for m in modes}
    for _ in range(args.rounds):
        for mode in modes:
            env = {"HOROVOD_SPARK_FORCE_TCP": "1",
                   "HOROVOD_SPARK_MESH_INTEGRITY": mode.replace("-base", "")}
            here = os.getcwd()
            if mode.endswith("-base"):  # its ranks import the baseline's build: `-m` looks in
                env["PYTHONPATH"] = os.path.abspath(args.baseline)  # their cwd first
                os.chdir(args.baseline)
            try:
                results = run_local(_rank, args.np, args=(sizes, args.reps, args.budget),
                                    env=env, timeout=1200)
            finally:
                os.chdir(here)
            assert {r["integrity"] for r in results} == {mode.replace("-base", "")}
            built = os.path.abspath(args.baseline) if mode.endswith("-base") else REPO
            assert {r["from"] for r in results} == {built}, (mode, results[0]["from"])
            for s in sizes:
                best[mode][s] = min(best[mode][s], max(r["times"][s] for r in results))
    rows = [{"size": s, "count": s // 4, "dtype": "float32",
             "results": {m: {"time_us": best[m][s]} for m in modes}} for s in sizes]
    complete(rows, "allreduce", args.np)
    ratios = [("control", "off"), ("payload", "off")] + \
        ([("payload", "payload-base")] if args.baseline else [])
    print(format_table(rows, modes, ratios,
                       title=f"allreduce over TCP, {args.np} ranks, best of {args.rounds} rounds"))
    print(write_json("mesh_integrity", {"np": args.np, "rows": rows}))


if __name__ == "__main__":
    main()
