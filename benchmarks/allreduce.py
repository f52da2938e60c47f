"""Allreduce: ours (shared memory, forced TCP) against torch.distributed Gloo and
mpi4py over MPICH, in one run, on this machine.

    python benchmarks/allreduce.py                 # 2 ranks, 4 KiB .. 64 MiB float32
    python benchmarks/allreduce.py --np 4 --min 4K --max 16M
    python benchmarks/allreduce.py --only shm,mpich --raw

Every implementation runs the same loop in its own group of rank processes:
per size, warm up, then `reps` times: barrier, time `iters` in-place
allreduces; the best run counts (the machine is shared), and the slowest rank
counts.  Ours goes through the public Communicator
(`comm.allreduce(x, out=x)`); `--raw` adds a column calling the native
backend directly, to show what the Python front end costs.  Then: 200
separate 16 KiB allreduces (no fusion) per implementation, and the peak RSS
growth of each rank during one 256 MiB allreduce.  The table is
nccl-tests-style; JSON goes to benchmarks/results/.  The machine is shared:
numbers are noisy, and the JSON records the load average.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _table import complete, format_table, human_size, parse_size, size_range, write_json  # noqa: E402

IMPLS = ("shm", "tcp", "gloo", "mpich")
RATIOS = (("shm", "mpich"), ("shm", "gloo"), ("tcp", "gloo"), ("tcp", "mpich"))


# -- the loops every implementation runs, in its rank processes ---------------
def _iters(nbytes: int, budget: float) -> int:
    return int(max(5, min(5000, budget * 4e9 / max(nbytes, 1) / 4)))


def _time_sizes(allreduce, barrier, make, spec) -> dict:
    """Per size: the best of `reps` timed runs of `iters` ops (the machine is shared)."""
    out = {}
    for nbytes in spec["sizes"]:
        buf = make(nbytes)
        iters = _iters(nbytes, spec["budget"] / spec["reps"])
        for _ in range(max(3, iters // 10)):
            allreduce(buf)
        best = float("inf")
        for _ in range(spec["reps"]):
            barrier()
            t = time.perf_counter()
            for _ in range(iters):
                allreduce(buf)
            best = min(best, (time.perf_counter() - t) / iters)
        out[nbytes] = best * 1e6
        barrier()
    return out


def _time_many(allreduce, barrier, make, spec) -> float:
    """Microseconds for 200 separate 16 KiB allreduces, back to back."""
    bufs = [make(16 * 1024) for _ in range(200)]
    for b in bufs:
        allreduce(b)
    best = float("inf")
    for _ in range(spec["many_reps"]):
        barrier()
        t = time.perf_counter()
        for b in bufs:
            allreduce(b)
        best = min(best, time.perf_counter() - t)
    return best * 1e6


def _peak_rss(allreduce, barrier, make, spec) -> dict:
    import resource

    allreduce(make(4096))  # connections and shared memory are up
    barrier()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    buf = make(spec["memory_bytes"])
    allreduce(buf)
    barrier()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    del buf
    return {"input_mib": spec["memory_bytes"] / 2**20, "grew_mib": (peak - before) / 2**20,
            "peak_mib": peak / 2**20}


def _run_all(allreduce, barrier, make, spec) -> dict:
    res = {}
    if spec["memory_bytes"]:  # first: ru_maxrss is a lifetime peak
        res["memory"] = _peak_rss(allreduce, barrier, make, spec)
    res["sizes"] = _time_sizes(allreduce, barrier, make, spec)
    if spec["many_reps"]:
        res["many_us"] = _time_many(allreduce, barrier, make, spec)
    return res


# -- implementations ---------------------------------------------------------
def _ours_rank(spec, raw):
    import numpy as np

    import collectives
    from collectives.types import DType, ReduceOp

    comm = collectives.init()
    make = lambda n: np.zeros(n // 4, np.float32)  # noqa: E731
    if raw:
        be = comm.backend
        allreduce = lambda x: be.allreduce(x, x, DType.FLOAT32, ReduceOp.SUM)  # noqa: E731
    else:
        allreduce = lambda x: comm.allreduce(x, out=x)  # noqa: E731
    try:
        return _run_all(allreduce, comm.barrier, make, spec)
    finally:
        comm.close()


def _gloo_rank(spec, port):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, size = int(os.environ["HVS_RANK"]), int(os.environ["HVS_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    make = lambda n: torch.zeros(n // 4, dtype=torch.float32)  # noqa: E731
    try:
        return _run_all(dist.all_reduce, dist.barrier, make, spec)
    finally:
        dist.destroy_process_group()


def _mpi_rank(spec) -> None:
    """Under mpiexec: rank 0 prints one JSON line with every rank's results."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    make = lambda n: np.zeros(n // 4, np.float32)  # noqa: E731
    allreduce = lambda x: comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)  # noqa: E731
    res = _run_all(allreduce, comm.Barrier, make, spec)
    everyone = comm.gather(res, root=0)
    if comm.rank == 0:
        print("MPI-RESULTS " + json.dumps(everyone), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_impl(name: str, n: int, spec: dict, raw: bool = False) -> list:
    """Every rank's results for one implementation."""
    from collectives.launch import run_local

    if name in ("shm", "tcp", "shm-raw", "tcp-raw"):
        env = {"HOROVOD_SPARK_FORCE_TCP": "1"} if name.startswith("tcp") else {}
        return run_local(_ours_rank, n, args=(spec, name.endswith("raw")), env=env, timeout=1800,
                         prefix_output=False)
    if name == "gloo":
        return run_local(_gloo_rank, n, args=(spec, _free_port()), timeout=1800, prefix_output=False)
    if name == "mpich":
        cmd = ["mpiexec", "-n", str(n), sys.executable, os.path.abspath(__file__), "--mpi-rank",
               json.dumps(spec)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        for line in proc.stdout.splitlines():
            if line.startswith("MPI-RESULTS "):
                return [_int_keys(r) for r in json.loads(line[len("MPI-RESULTS "):])]
        raise RuntimeError(f"mpiexec failed ({proc.returncode}): {proc.stderr[-2000:]}")
    raise ValueError(f"unknown implementation {name!r}")


def _best(a: list, b: list) -> list:
    """Rank by rank, the faster of two rounds (the peak memory of the first)."""
    out = []
    for ra, rb in zip(a, b):
        r = dict(ra)
        r["sizes"] = {k: min(v, rb["sizes"][k]) for k, v in ra["sizes"].items()}
        if "many_us" in ra:
            r["many_us"] = min(ra["many_us"], rb["many_us"])
        out.append(r)
    return out


def _int_keys(res: dict) -> dict:
    res["sizes"] = {int(k): v for k, v in res["sizes"].items()}
    return res


# -- driver ------------------------------------------------------------------
def _tables(per_impl: dict, n: int, spec: dict, impls: list) -> tuple:
    rows = []
    for nbytes in spec["sizes"]:
        results = {name: {"time_us": max(r["sizes"][nbytes] for r in ranks)}
                   for name, ranks in per_impl.items()}
        rows.append({"size": nbytes, "count": nbytes // 4, "dtype": "float", "results": results})
    complete(rows, "allreduce", n)
    ratios = [(a, b) for a, b in RATIOS if a in impls and b in impls]
    ratios += [("shm-raw", "mpich")] if "shm-raw" in impls and "mpich" in impls else []
    text = [format_table(rows, impls, ratios, f"allreduce, {n} ranks, in place, float32 sum, "
                                              f"best of {spec['reps']} runs per size")]
    many = {name: max(r.get("many_us", 0) for r in ranks) for name, ranks in per_impl.items()}
    if spec["many_reps"]:
        text.append("\n# 200 separate allreduces of 16 KiB float32 (no fusion), best of "
                    f"{spec['many_reps']}")
        text.append(f"# {'impl':>8} {'total(us)':>10} {'per op(us)':>11}")
        for name in impls:
            text.append(f"  {name:>8} {many[name]:>10.0f} {many[name] / 200:>11.1f}")
    memory = {name: [r.get("memory") for r in ranks] for name, ranks in per_impl.items()}
    if spec["memory_bytes"]:
        text.append(f"\n# peak RSS growth per rank during one {human_size(spec['memory_bytes'])} "
                    "allreduce (input included)")
        for name in impls:
            grew = ", ".join(f"{m['grew_mib']:.0f}" for m in memory[name] if m)
            text.append(f"  {name:>8} grew MiB per rank: {grew}")
    return rows, many, memory, "\n".join(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--min", default="4K", help="smallest message (default 4K)")
    p.add_argument("--max", default="64M", help="largest message (default 64M)")
    p.add_argument("--only", default=",".join(IMPLS), help=f"comma list of {', '.join(IMPLS)}")
    p.add_argument("--raw", action="store_true", help="also time the native backend without the front end")
    p.add_argument("--budget", type=float, default=0.3, help="seconds of timing per size")
    p.add_argument("--reps", type=int, default=3, help="timed runs per size; the best counts")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every implementation this many times, interleaved; the best counts")
    p.add_argument("--no-many", action="store_true", help="skip the 200 x 16 KiB case")
    p.add_argument("--memory", default="256M", help="message of the peak-RSS run; 0 skips it")
    p.add_argument("--mpi-rank", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.mpi_rank:
        _mpi_rank(json.loads(ns.mpi_rank))
        return 0
    sizes = size_range(ns.min, ns.max)
    spec = {"sizes": sizes, "budget": ns.budget, "reps": ns.reps, "many_reps": 0 if ns.no_many else 5,
            "memory_bytes": parse_size(ns.memory)}
    impls = [x for x in ns.only.split(",") if x]
    if ns.raw:
        impls += [f"{x}-raw" for x in ("shm", "tcp") if x in impls]
    per_impl = {}
    for rnd in range(ns.rounds):
        for name in impls:
            t = time.time()
            got = run_impl(name, ns.np, spec)
            per_impl[name] = got if name not in per_impl else _best(per_impl[name], got)
            print(f"# {name}: round {rnd + 1} done in {time.time() - t:.0f} s", file=sys.stderr,
                  flush=True)
    rows, many, memory, text = _tables(per_impl, ns.np, spec, impls)
    print(text)
    path = write_json(f"allreduce-np{ns.np}", {"command": " ".join(sys.argv), "np": ns.np,
                                                "rows": rows, "many_us": many, "memory": memory})
    print(f"# JSON: {os.path.relpath(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
