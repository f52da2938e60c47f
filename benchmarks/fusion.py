"""Fusion: 200 tensors of 16 KiB reduced per step, ours against torch.distributed Gloo.

    python benchmarks/fusion.py                  # 2 ranks, 30 timed repetitions
    python benchmarks/fusion.py --rounds 3       # every implementation 3 times, interleaved
    python benchmarks/fusion.py --np 3 --reps 50 --tensors 400 --kib 4

Implementations, each in its own group of rank processes (one thread each):

  ours            hvd.allreduce_async_ on every tensor, then hvd.synchronize on each
                  (negotiated and fused by the fusion engine)
  ours-grouped    hvd.grouped_allreduce_ of all of them, named (one call a step)
  ours-hooks      the same tensors as gradients of a 200-parameter model:
                  backward() with DistributedOptimizer's hooks, then synchronize()
  ours-mpi        `ours` with ranks started by mpiexec (the MPI backend under the engine)
  horovod         `ours` with Horovod itself (horovod.torch, its Gloo controller and ops,
                  started by horovodrun --gloo), where --horovod-python names an
                  interpreter that has Horovod (it does not build on this machine's
                  torch unless patched: see docs/benchmarks.md); its default settings
  horovod-grouped `ours-grouped` with Horovod
  horovod-hooks   `ours-hooks` with Horovod
  gloo            dist.all_reduce on each tensor, one after the other
  gloo-async      dist.all_reduce(async_op=True) on each tensor, then wait on each
  ddp             the same 200-parameter model under DistributedDataParallel (Gloo,
                  25 MiB buckets): backward() allreduces the buckets

A repetition starts on every rank after a barrier; its time is the slowest
rank's.  The table shows the median (and best) per repetition, over every
round, the ratio of each implementation's median and best to ours, and the
median CPU time per repetition summed over the ranks (every thread).  The machine is shared: numbers are
noisy; the JSON under benchmarks/results/ records the load average.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _peers import gloo_init, load, slowest, summarize, timed, with_free_port  # noqa: E402

IMPLS = ("ours", "ours-grouped", "ours-hooks", "ours-mpi", "horovod", "horovod-grouped",
         "horovod-hooks", "gloo", "gloo-async", "ddp")


def _tensors(spec):
    import torch

    return [torch.ones(spec["kib"] * 256) for _ in range(spec["tensors"])]


def _params_model(spec):
    import torch

    class Params(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ps = torch.nn.ParameterList(torch.nn.Parameter(t) for t in _tensors(spec))

        def forward(self):
            return sum(p.sum() for p in self.ps)

    return Params()


def _step(hvd, spec, mode: str):
    """One repetition of `mode` (ours-grouped, horovod-hooks, ...) with `hvd`: this project's
    module or Horovod's, which take the same calls."""
    import torch

    if mode.endswith("-hooks"):
        model = _params_model(spec)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                       named_parameters=model.named_parameters())

        def step():
            opt.zero_grad()
            model().backward()
            opt.synchronize()
            with opt.skip_synchronize():
                opt.step()
        return step
    ts = _tensors(spec)
    if mode.endswith("-grouped"):
        return lambda: hvd.grouped_allreduce_(ts, name="grads", op=hvd.Sum)
    names = [f"t{i}" for i in range(len(ts))]

    def step():
        hs = [hvd.allreduce_async_(t, name=n, op=hvd.Sum) for t, n in zip(ts, names)]
        for h in hs:
            hvd.synchronize(h)
    return step


def _ours_rank(spec, mode: str, keep: bool = False):
    import torch

    import horovod_spark.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    try:
        cpu: list = []
        times = timed(_step(hvd, spec, mode), hvd.barrier, spec["warmup"], spec["reps"], cpu)
        return {"times": times, "cpu": cpu, "metrics": hvd.metrics()}
    finally:
        if not keep:
            hvd.shutdown()


def _gloo_rank(spec, port: int, mode: str):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    gloo_init(port)
    try:
        if mode == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(_params_model(spec))

            def step():
                model.zero_grad()
                model().backward()
        else:
            ts = _tensors(spec)

            def step():
                if mode == "gloo":
                    for t in ts:
                        dist.all_reduce(t)
                else:
                    for w in [dist.all_reduce(t, async_op=True) for t in ts]:
                        w.wait()
        cpu: list = []
        return {"times": timed(step, dist.barrier, spec["warmup"], spec["reps"], cpu), "cpu": cpu}
    finally:
        dist.destroy_process_group()


def _mpi(n: int, spec: dict) -> list:
    """`ours` under mpiexec; rank 0 prints every rank's result as one JSON line."""
    cmd = ["mpiexec", "-n", str(n), sys.executable, os.path.abspath(__file__), "--mpi-rank",
           json.dumps(spec)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HVS_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.path.dirname(HERE))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("MPI-RESULTS "):
            return json.loads(line[len("MPI-RESULTS "):])
    raise RuntimeError(f"mpiexec failed ({proc.returncode}): {proc.stderr[-2000:]}")


def _mpi_rank(spec: dict) -> None:
    import horovod_spark.torch as hvd

    res = _ours_rank(spec, "ours-mpi", keep=True)
    everyone = hvd.allgather_object(res)
    if hvd.rank() == 0:
        print("MPI-RESULTS " + json.dumps(everyone), flush=True)
    hvd.shutdown()


def _horovod(n: int, spec: dict, python: str, mode: str) -> list:
    """`ours` (or ours-grouped, ours-hooks: `mode`) with Horovod under horovodrun --gloo;
    rank 0 prints every rank's result as one JSON line."""
    spec = dict(spec, mode=mode)
    cmd = [python, "-m", "horovod.runner.launch", "--gloo", "-np", str(n), "-H", f"localhost:{n}",
           python, os.path.abspath(__file__), "--horovod-rank", json.dumps(spec)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HVS_", "HOROVOD_"))}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    for line in proc.stdout.splitlines():
        if "HVD-RESULTS " in line:  # horovodrun prefixes each line with its rank
            return json.loads(line.split("HVD-RESULTS ", 1)[1])
    raise RuntimeError(f"horovodrun failed ({proc.returncode}): {proc.stdout[-1000:]} {proc.stderr[-2000:]}")


def _horovod_rank(spec: dict) -> None:
    import horovod.torch as hvd  # Horovod itself: this process is horovodrun's
    import torch

    torch.set_num_threads(1)
    hvd.init()
    step = _step(hvd, spec, spec["mode"])
    cpu: list = []
    times = timed(step, lambda: hvd.allreduce(torch.zeros(1), name="barrier"), spec["warmup"],
                  spec["reps"], cpu)
    everyone = hvd.allgather_object({"times": times, "cpu": cpu})
    if hvd.rank() == 0:
        print("HVD-RESULTS " + json.dumps(everyone), flush=True)
    hvd.shutdown()


def run_impl(name: str, n: int, spec: dict, horovod_python: str = "") -> list:
    from collectives.launch import run_local

    env = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    if name == "ours-mpi":
        return _mpi(n, spec)
    if name.startswith("horovod"):
        return _horovod(n, spec, horovod_python, name)
    if name.startswith("ours"):
        return run_local(_ours_rank, n, args=(spec, name), env=env,
                         timeout=1200, prefix_output=False)
    return with_free_port(lambda port: run_local(_gloo_rank, n, args=(spec, port, name), env=env,
                                                 timeout=1200, prefix_output=False))


def table(results: dict, spec: dict, n: int) -> str:
    ours = results["ours"]["median_s"] if "ours" in results else None
    total_kib = spec["tensors"] * spec["kib"]
    reps = next(iter(results.values()))["reps"] if results else 0
    lines = [f"# {spec['tensors']} tensors x {spec['kib']} KiB float32 ({total_kib} KiB) summed "
             f"over {n} ranks per repetition; {reps} repetitions per implementation",
             f"# {'impl':>15} {'median(ms)':>11} {'best(ms)':>9} {'per tensor(us)':>15} "
             f"{'median/ours':>12} {'best/ours':>10} {'cpu(ms)':>8} {'cpu/ours':>9}"]
    ours_cpu = results.get("ours", {}).get("cpu_median_s")
    best = results["ours"]["best_s"] if "ours" in results else None
    for name, res in results.items():
        ratio = f"{res['median_s'] / ours:>11.1f}x" if ours else f"{'-':>12}"
        bratio = f"{res['best_s'] / best:>9.1f}x" if best else f"{'-':>10}"
        cpu = res.get("cpu_median_s")
        cpu_txt = f"{cpu * 1e3:>8.2f}" if cpu is not None else f"{'-':>8}"
        cratio = f"{cpu / ours_cpu:>8.1f}x" if cpu is not None and ours_cpu else f"{'-':>9}"
        lines.append(f"  {name:>15} {res['median_s'] * 1e3:>11.2f} {res['best_s'] * 1e3:>9.2f} "
                     f"{res['median_s'] / spec['tensors'] * 1e6:>15.1f} {ratio} {bratio} "
                     f"{cpu_txt} {cratio}")
    lines.append("# cpu: median CPU ms per repetition, every thread of every rank (less load-bound "
                 "than wall time on a shared machine)")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--tensors", type=int, default=200)
    p.add_argument("--kib", type=int, default=16, help="KiB per tensor (default 16)")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=1,
                   help="run every implementation this many times, interleaved (load drifts)")
    p.add_argument("--only", default=",".join(IMPLS))
    p.add_argument("--horovod-python", default=os.environ.get("HOROVOD_PYTHON", ""),
                   help="an interpreter with Horovod installed (default $HOROVOD_PYTHON); "
                        "without one the horovod rows are left out")
    p.add_argument("--mpi-rank", help=argparse.SUPPRESS)
    p.add_argument("--horovod-rank", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.mpi_rank:
        _mpi_rank(json.loads(ns.mpi_rank))
        return 0
    if ns.horovod_rank:
        _horovod_rank(json.loads(ns.horovod_rank))
        return 0
    spec = {"tensors": ns.tensors, "kib": ns.kib, "reps": ns.reps, "warmup": ns.warmup}
    results, raw, times, cpus, load_before = {}, {}, {}, {}, load()
    for k in range(ns.rounds):
        for name in [x for x in ns.only.split(",") if x]:
            if name.startswith("horovod") and not ns.horovod_python:
                print(f"# {name}: left out (no --horovod-python)", file=sys.stderr)
                continue
            t = time.time()
            raw[name] = run_impl(name, ns.np, spec, ns.horovod_python)
            times.setdefault(name, []).extend(slowest([r["times"] for r in raw[name]]))
            cpus.setdefault(name, []).extend(sum(c) for c in zip(*[r["cpu"] for r in raw[name]]))
            print(f"# round {k}: {name}: done in {time.time() - t:.0f} s", file=sys.stderr,
                  flush=True)
    results = {name: summarize(ts) for name, ts in times.items()}
    for name, cs in cpus.items():  # CPU of every rank: what the work costs, load or not
        results[name]["cpu_median_s"] = statistics.median(cs)
    text = table(results, spec, ns.np)
    print(text)
    from _table import write_json

    metrics = {k: v[0].get("metrics") for k, v in raw.items() if "metrics" in v[0]}
    path = write_json(f"fusion-np{ns.np}", {"command": " ".join(sys.argv), "np": ns.np, "spec": spec,
                                            "results": results, "ours_metrics_rank0": metrics,
                                            "load_before": load_before, "load_after": load(),
                                            "table": text})
    print(f"# JSON: {os.path.relpath(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
