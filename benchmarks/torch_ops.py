"""Blocking torch ops per call: `hvd.allreduce_` through the engine's lane, through the
engine's Python cycle (HOROVOD_SPARK_TORCH_LANE=0), and torch.distributed Gloo, in one run.

    python benchmarks/torch_ops.py                     # 2 ranks, 4 KiB .. 16 MiB float32
    python benchmarks/torch_ops.py --np 1 --max 1M
    python benchmarks/torch_ops.py --np 3 --only lane,engine

This is the CPU half of what a Horovod script pays per blocking op (a metric or a loss
averaged each step, a custom loop's named allreduces): every implementation runs the
same loop in its own group of rank processes: per size, warm up, then `reps` times:
barrier, time `iters` in-place Sum allreduces of one named CPU float32 tensor; the best
run counts (the machine is shared), and the slowest rank counts.  `comm` is the floor:
the communicator's own allreduce of a numpy array (no engine, no torch).  Then 20 named
metrics of 4 floats each, one after another, as a training loop's logging does.  Prints
an nccl-tests-style table with the ratios and the per-op microseconds each path adds to
the communicator's; JSON goes to benchmarks/results/.  Numbers are noisy: the JSON
records the load average.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _peers import free_port, gloo_init, load  # noqa: E402
from _table import complete, format_table, human_size, size_range, write_json  # noqa: E402

IMPLS = ("lane", "engine", "gloo", "comm")
RATIOS = (("lane", "gloo"), ("engine", "gloo"), ("lane", "engine"))
METRICS = 20


def _iters(nbytes: int, budget: float) -> int:
    return int(max(5, min(4000, budget * 2e9 / max(nbytes, 1))))


def _loop(op, barrier, make, spec) -> dict:
    """{"sizes": {bytes: us per op}, "metrics_us": us for METRICS named 4-float ops}."""
    sizes = {}
    for nbytes in spec["sizes"]:
        x = make(nbytes // 4)
        iters = _iters(nbytes, spec["budget"] / spec["reps"])
        for _ in range(max(3, iters // 10)):
            op(x, "bench.size")
        best = float("inf")
        for _ in range(spec["reps"]):
            barrier()
            t = time.perf_counter()
            for _ in range(iters):
                op(x, "bench.size")
            best = min(best, (time.perf_counter() - t) / iters)
        sizes[nbytes] = best * 1e6
    ms = [make(4) for _ in range(METRICS)]
    names = [f"bench.metric.{i}" for i in range(METRICS)]
    best = float("inf")
    for rep in range(spec["reps"] * 20):
        barrier()
        t = time.perf_counter()
        for m, name in zip(ms, names):
            op(m, name)
        if rep >= 5:  # the first ones arm the names
            best = min(best, time.perf_counter() - t)
    barrier()
    return {"sizes": sizes, "metrics_us": best * 1e6}


def _hvd_rank(spec):
    import torch

    import horovod_spark.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    try:
        res = _loop(lambda x, name: hvd.allreduce_(x, name=name, op=hvd.Sum), hvd.barrier,
                    lambda n: torch.zeros(n, dtype=torch.float32), spec)
        res["lane_cycles"] = int(hvd.metrics()["engine_lane_cycles"])
        return res
    finally:
        hvd.shutdown()


def _gloo_rank(spec, port):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    gloo_init(port)
    try:
        return _loop(lambda x, name: dist.all_reduce(x), dist.barrier,
                     lambda n: torch.zeros(n, dtype=torch.float32), spec)
    finally:
        dist.destroy_process_group()


def _comm_rank(spec):
    import numpy as np

    import collectives

    comm = collectives.init()
    try:
        return _loop(lambda x, name: comm.allreduce(x, out=x), comm.barrier,
                     lambda n: np.zeros(n, np.float32), spec)
    finally:
        comm.close()


def run_impl(name: str, n: int, spec: dict) -> list:
    from collectives.launch import run_local

    env = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    if name in ("lane", "engine"):
        env["HOROVOD_SPARK_TORCH_LANE"] = "1" if name == "lane" else "0"
        return run_local(_hvd_rank, n, args=(spec,), env=env, timeout=1800, prefix_output=False)
    if name == "gloo":
        return run_local(_gloo_rank, n, args=(spec, free_port()), env=env, timeout=1800,
                         prefix_output=False)
    if name == "comm":
        return run_local(_comm_rank, n, args=(spec,), env=env, timeout=1800, prefix_output=False)
    raise ValueError(f"unknown implementation {name!r}; use {', '.join(IMPLS)}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--min", default="4K", help="smallest message (default 4K)")
    p.add_argument("--max", default="16M", help="largest message (default 16M)")
    p.add_argument("--only", default=",".join(IMPLS), help=f"comma list of {', '.join(IMPLS)}")
    p.add_argument("--budget", type=float, default=0.3, help="seconds of timing per size")
    p.add_argument("--reps", type=int, default=3, help="timed runs per size; the best counts")
    args = p.parse_args(argv)
    impls = [s.strip() for s in args.only.split(",") if s.strip()]
    bad = [s for s in impls if s not in IMPLS]
    if bad:
        p.error(f"unknown implementation(s) {bad}; use {', '.join(IMPLS)}")
    sizes = size_range(args.min, args.max, 4)
    spec = {"sizes": sizes, "budget": args.budget, "reps": args.reps}
    t0, before = time.perf_counter(), load()
    per_impl = {name: run_impl(name, args.np, spec) for name in impls}
    rows = []
    for nbytes in sizes:
        results = {name: {"time_us": max(r["sizes"][nbytes] for r in ranks)}
                   for name, ranks in per_impl.items()}
        rows.append({"size": nbytes, "count": nbytes // 4, "dtype": "float", "results": results})
    complete(rows, "allreduce", args.np)
    ratios = [(a, b) for a, b in RATIOS if a in impls and b in impls]
    print(format_table(rows, impls, ratios, f"hvd.allreduce_ (named, blocking, CPU float32, Sum), "
                                            f"{args.np} rank(s), best of {args.reps} runs per size; "
                                            "ratios are busbw a / busbw b (above 1: a is faster)"))
    if "comm" in impls:
        print("\n# microseconds per op over the communicator's own allreduce (comm)")
        print(f"# {'size':>8}" + "".join(f" {name:>9}" for name in impls if name != "comm"))
        for row in rows:
            floor = row["results"]["comm"]["time_us"]
            print(f"  {human_size(row['size']):>8}" + "".join(
                f" {row['results'][name]['time_us'] - floor:>+9.1f}" for name in impls if name != "comm"))
    metrics = {name: max(r["metrics_us"] for r in ranks) for name, ranks in per_impl.items()}
    print(f"\n# {METRICS} named metrics of 4 floats, one after another (a logging step), best run")
    for name in impls:
        print(f"  {name:>8} {metrics[name]:>9.1f} us  ({metrics[name] / METRICS:.1f} us per op)")
    lane_cycles = {name: [r.get("lane_cycles") for r in ranks] for name, ranks in per_impl.items()
                   if name in ("lane", "engine")}
    print(f"\n# lane cycles per rank: {lane_cycles}; load average {before} -> {load()}; "
          f"{time.perf_counter() - t0:.0f} s")
    path = write_json("torch_ops", {"np": args.np, "spec": spec, "rows": rows, "metrics_us": metrics,
                                    "lane_cycles": lane_cycles})
    print(f"# JSON: {os.path.relpath(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
