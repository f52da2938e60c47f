"""Training throughput and scaling: a small CNN on synthetic data, ours against DDP over Gloo.

    python benchmarks/training.py                   # batch 32 per rank, 2 ranks
    python benchmarks/training.py --steps 60 --rounds 3 --batch 64

Configurations, each in its own group of rank processes, one thread per rank
(torch.set_num_threads(1)); the same model, data and SGD step everywhere:

  local      one process, no communication at all (the ideal single worker)
  ours-1/2   horovod_spark.torch: DistributedOptimizer with its defaults (gradient hooks +
             fusion engine; num_groups=None picks one group at the end of backward on CPU
             ranks without a spare core, as here, and overlap elsewhere)
  overlap-1/2  the same with num_groups=0: each gradient submitted as soon as it is ready,
             overlapping backward (the default where a rank has a spare core or a GPU)
  ddp-1/2    torch DistributedDataParallel over Gloo (25 MiB buckets)
  horovod    Horovod's own torch API, where horovod is installed

Throughput is samples per second over every rank (batch x ranks x steps over
the slowest rank's time for `steps` timed steps after `warmup`).  Scaling
efficiency = throughput with 2 ranks / (2 x throughput with 1 rank), for each
framework against its own 1-rank run and against `local`.  Every
configuration runs `rounds` times, interleaved, and the best round counts (the
machine is shared; the JSON records every round and the load average).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _peers import gloo_init, load, with_free_port  # noqa: E402


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(32 * 6 * 6, 64), nn.ReLU(), nn.Linear(64, 10))


def _data(spec, rank: int):
    import torch

    g = torch.Generator().manual_seed(rank)
    x = torch.randn(spec["batch"], 3, 32, 32, generator=g)
    return x, torch.randint(0, 10, (spec["batch"],), generator=g)


def _loop(spec, model, opt, barrier) -> float:
    """(wall seconds, CPU seconds) of spec['steps'] timed steps, between two barriers."""
    import torch.nn.functional as F

    x, y = _data(spec, int(os.environ.get("HVS_RANK", "0")))

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(spec["warmup"]):
        step()
    barrier()
    t, cpu = time.perf_counter(), _cpu()
    for _ in range(spec["steps"]):
        step()
    barrier()
    return time.perf_counter() - t, _cpu() - cpu


def _cpu() -> float:
    """CPU seconds of this process, every thread (compute, engine, backend) included."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _rank(spec, impl: str, port: int):
    import torch

    torch.set_num_threads(1)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if impl == "local":
        return dict(zip(("seconds", "cpu_s"), _loop(spec, model, opt, lambda: None)))
    if impl in ("ours", "overlap"):
        import horovod_spark.torch as hvd

        return _hvd_rank(spec, hvd, model, opt, {"num_groups": 0} if impl == "overlap" else {})
    if impl == "horovod":
        import horovod.torch as hvd

        return _hvd_rank(spec, hvd, model, opt)
    import torch.distributed as dist

    gloo_init(port)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        return dict(zip(("seconds", "cpu_s"), _loop(spec, ddp, opt, dist.barrier)))
    finally:
        dist.destroy_process_group()


def _hvd_rank(spec, hvd, model, opt, extra=None):
    hvd.init()
    try:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        dopt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                        **(extra or {}))
        out = dict(zip(("seconds", "cpu_s"), _loop(spec, model, dopt, hvd.barrier)))
        if hasattr(hvd, "metrics"):
            out["metrics"] = hvd.metrics()
        return out
    finally:
        hvd.shutdown()


def run(impl: str, n: int, spec: dict) -> tuple:
    """(samples per second over every rank, CPU ms per step of rank 0, rank 0's metrics)."""
    from collectives.launch import run_local

    env = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    per_rank = with_free_port(lambda port: run_local(_rank, n, args=(spec, impl, port), env=env,
                                                     timeout=1800, prefix_output=False))
    seconds = max(r["seconds"] for r in per_rank)
    cpu_ms = per_rank[0]["cpu_s"] / spec["steps"] * 1e3
    return spec["batch"] * n * spec["steps"] / seconds, cpu_ms, per_rank[0].get("metrics")


def _configs(ns) -> list:
    impls = [("local", 1), ("ours", 1), ("ours", 2), ("overlap", 1), ("overlap", 2),
             ("ddp", 1), ("ddp", 2)]
    if importlib.util.find_spec("horovod") is not None:
        impls += [("horovod", 1), ("horovod", 2)]
    return impls


def table(best: dict, cpu: dict) -> str:
    local = best[("local", 1)]
    lines = ["# samples/s (best round); efficiency = 2-rank / (2 x 1-rank); CPU ms per step of "
             "rank 0 (every thread), least over rounds",
             f"# {'impl':>8} {'1 rank':>9} {'2 ranks':>9} {'eff(own 1)':>11} {'eff(local)':>11} "
             f"{'cpu 1':>7} {'cpu 2':>7}"]
    lines.append(f"  {'local':>8} {local:>9.1f} {'-':>9} {'-':>11} {'-':>11} "
                 f"{cpu[('local', 1)]:>7.1f} {'-':>7}")
    for impl in ("ours", "overlap", "ddp", "horovod"):
        if (impl, 2) not in best:
            continue
        one, two = best[(impl, 1)], best[(impl, 2)]
        lines.append(f"  {impl:>8} {one:>9.1f} {two:>9.1f} {two / (2 * one):>11.3f} "
                     f"{two / (2 * local):>11.3f} {cpu[(impl, 1)]:>7.1f} {cpu[(impl, 2)]:>7.1f}")
    if ("horovod", 2) not in best:
        lines.append("# horovod: not installed, not measured")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    ns = p.parse_args(argv)
    spec = {"batch": ns.batch, "steps": ns.steps, "warmup": ns.warmup}
    rounds, cpus, metrics, load_before = [], [], {}, load()
    for k in range(ns.rounds):
        got, cpu = {}, {}
        for impl, n in _configs(ns):
            got[(impl, n)], cpu[(impl, n)], m = run(impl, n, spec)
            metrics[f"{impl}-{n}-round{k}"] = m
            print(f"# round {k}: {impl} x{n}: {got[(impl, n)]:.1f} samples/s, "
                  f"{cpu[(impl, n)]:.1f} CPU ms/step", file=sys.stderr, flush=True)
        rounds.append(got)
        cpus.append(cpu)
    best = {key: max(r[key] for r in rounds) for key in rounds[0]}
    least_cpu = {key: min(c[key] for c in cpus) for key in cpus[0]}
    text = table(best, least_cpu)
    print(text)
    from _table import write_json

    path = write_json("training-np2", {
        "command": " ".join(sys.argv), "spec": spec, "load_before": load_before,
        "rounds": [{f"{i}-{n}": v for (i, n), v in r.items()} for r in rounds],
        "cpu_ms_per_step": [{f"{i}-{n}": v for (i, n), v in c.items()} for c in cpus],
        "load_after": load(),
        "best": {f"{i}-{n}": v for (i, n), v in best.items()}, "ours_metrics_rank0": metrics,
        "table": text})
    print(f"# JSON: {os.path.relpath(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
