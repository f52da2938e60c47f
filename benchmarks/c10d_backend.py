"""torch.distributed's "hvs" backend against Gloo and the Horovod-style path, in one run.

    python benchmarks/c10d_backend.py                  # 2 ranks, 4 KiB .. 64 MiB, then DDP/FSDP2
    python benchmarks/c10d_backend.py --tcp            # each rank its own host: TCP, not shm
    python benchmarks/c10d_backend.py --ops-only --max 1M

Every rank process holds a Gloo world group, an "hvs" group over the same ranks and the
Horovod-style path (`import horovod_spark.torch as hvd`), so the implementations share
the processes, the launcher and one thread per rank, and run interleaved: per size, each
implementation in turn, `reps` times; the best run counts (the machine is shared) and
the slowest rank counts.  Ops: all_reduce (Sum), all_gather_into_tensor,
reduce_scatter_tensor (Sum) of CPU float32; `hvd` is hvd.allreduce_ (the lane),
hvd.allgather and hvd.reducescatter.  Then training steps of a wide MLP (about 50M
parameters, batch 8): DDP over Gloo and over hvs, FSDP2 (fully_shard per layer) over each,
interleaved step by step, median step time; `none` is the same step with no
communication (the floor), and "beyond none" what each backend adds to it.  `--tcp` starts each rank as its own host, so
the package's transport takes TCP over loopback as it does between hosts (Gloo always
does).  JSON goes to benchmarks/results/.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _peers import free_port, gloo_init, load  # noqa: E402
from _table import complete, format_table, size_range, write_json  # noqa: E402

IMPLS = ("hvs", "gloo", "hvd")
OPS = ("allreduce", "allgather", "reducescatter")
TITLES = {"allreduce": "all_reduce (Sum)", "allgather": "all_gather_into_tensor",
          "reducescatter": "reduce_scatter_tensor (Sum)"}


def _iters(nbytes: int, budget: float) -> int:
    return int(max(3, min(2000, budget * 1e9 / max(nbytes, 1))))


def _ops(groups, hvd, size: int):
    """{op: {impl: fn(x)}} with the buffers each needs; x is the op's input of n floats."""
    import torch
    import torch.distributed as dist

    def ar(group):
        return lambda x, o: dist.all_reduce(x, group=group)

    def ag(group):
        return lambda x, o: dist.all_gather_into_tensor(o, x, group=group)

    def rs(group):
        return lambda x, o: dist.reduce_scatter_tensor(o, x, group=group)

    def out(kind, x):
        if kind == "allgather":
            return torch.empty(x.numel() * size)
        if kind == "reducescatter":
            return torch.empty(x.numel() // size)
        return None

    table = {"allreduce": {"hvs": ar(groups["hvs"]), "gloo": ar(groups["gloo"]),
                           "hvd": lambda x, o: hvd.allreduce_(x, name="bench.ar", op=hvd.Sum)},
             "allgather": {"hvs": ag(groups["hvs"]), "gloo": ag(groups["gloo"]),
                           "hvd": lambda x, o: hvd.allgather(x, name="bench.ag")},
             "reducescatter": {"hvs": rs(groups["hvs"]), "gloo": rs(groups["gloo"]),
                               "hvd": lambda x, o: hvd.reducescatter(x, name="bench.rs",
                                                                     op=hvd.Sum)}}
    return table, out


def _time_ops(spec, groups, hvd) -> dict:
    """{op: {impl: {nbytes: best us per op}}}, interleaved per size."""
    import torch
    import torch.distributed as dist

    size = dist.get_world_size()
    table, out = _ops(groups, hvd, size)
    got = {op: {impl: {} for impl in spec["impls"]} for op in OPS}
    for op in OPS:
        for nbytes in spec["sizes"]:
            n = max(size, nbytes // 4 // size * size)
            x = torch.ones(n)
            o = out(op, x)
            iters = _iters(nbytes, spec["budget"] / spec["reps"])
            best = {impl: float("inf") for impl in spec["impls"]}
            for impl in spec["impls"]:
                for _ in range(max(2, iters // 10)):
                    table[op][impl](x, o)
            for _ in range(spec["reps"]):
                for impl in spec["impls"]:
                    dist.barrier(group=groups["gloo"])
                    t = time.perf_counter()
                    for _ in range(iters):
                        table[op][impl](x, o)
                    best[impl] = min(best[impl], (time.perf_counter() - t) / iters)
            for impl in spec["impls"]:
                got[op][impl][nbytes] = best[impl] * 1e6
    return got


def _mlp(spec):
    import torch

    torch.manual_seed(0)
    width, layers = spec["width"], spec["layers"]
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods)


def _trainers(spec, groups) -> dict:
    """{name: step()} for DDP and FSDP2 over Gloo and hvs."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    import torch.distributed as dist

    x = torch.randn(spec["batch"], spec["width"])
    alone = _mlp(spec)  # the floor: the same step with no communication
    steps = {"none": _step(alone, torch.optim.SGD(alone.parameters(), lr=1e-4), x)}
    for backend in ("gloo", "hvs"):
        group = groups[backend]
        if "ddp" in spec["train"]:
            model = DDP(_mlp(spec), process_group=group)
            opt = torch.optim.SGD(model.parameters(), lr=1e-4)
            steps[f"ddp-{backend}"] = _step(model, opt, x)
        if "fsdp2" in spec["train"]:
            mesh = DeviceMesh.from_group(group, "cpu")
            model = _mlp(spec)
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = torch.optim.SGD(model.parameters(), lr=1e-4)
            steps[f"fsdp2-{backend}"] = _step(model, opt, x)
    del dist
    return steps


def _step(model, opt, x):
    def step():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return step


def _time_training(spec, groups) -> dict:
    import torch.distributed as dist

    steps = _trainers(spec, groups)
    for step in steps.values():
        step()  # the first step builds buckets and shards
    times = {name: [] for name in steps}
    for _ in range(spec["steps"]):
        for name, step in steps.items():
            dist.barrier(group=groups["gloo"])
            t = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t)
    return times


def _rank(spec, port: int) -> dict:
    import torch
    import torch.distributed as dist

    import horovod_spark.torch as hvd

    torch.set_num_threads(1)
    gloo_init(port)
    hvd.init()
    groups = {"gloo": dist.group.WORLD, "hvs": dist.new_group(backend="hvs")}
    try:
        res = {"ops": _time_ops(spec, groups, hvd) if spec["sizes"] else {}}
        res["train"] = _time_training(spec, groups) if spec["train"] else {}
        return res
    finally:
        hvd.shutdown()
        dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--min", default="4K", help="smallest message (default 4K)")
    p.add_argument("--max", default="64M", help="largest message (default 64M)")
    p.add_argument("--budget", type=float, default=0.2, help="seconds of timing per size and op")
    p.add_argument("--reps", type=int, default=3, help="timed runs per size; the best counts")
    p.add_argument("--tcp", action="store_true", help="each rank its own host (TCP, not shm)")
    p.add_argument("--ops-only", action="store_true", help="no training steps")
    p.add_argument("--train-only", action="store_true", help="no op sweep")
    p.add_argument("--width", type=int, default=2896, help="MLP width (6 layers of 2896: 50M)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10, help="timed training steps per model")
    args = p.parse_args(argv)
    from collectives.launch import run_local

    spec = {"sizes": [] if args.train_only else size_range(args.min, args.max, 4),
            "budget": args.budget, "reps": args.reps, "impls": IMPLS,
            "train": [] if args.ops_only else ["ddp", "fsdp2"], "width": args.width,
            "layers": args.layers, "batch": args.batch, "steps": args.steps}
    env = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    hosts = [f"host{r}" for r in range(args.np)] if args.tcp else None
    where = f"{args.np} ranks, " + ("each its own host (TCP over loopback)" if args.tcp
                                    else "one host (shared memory)")
    t0, before = time.perf_counter(), load()
    ranks = run_local(_rank, args.np, args=(spec, free_port()), env=env, hosts=hosts,
                      timeout=3600, prefix_output=False)
    out = {"np": args.np, "tcp": args.tcp, "spec": spec, "tables": {}}
    for op in OPS if spec["sizes"] else ():
        rows = []
        for nbytes in spec["sizes"]:
            res = {impl: {"time_us": max(r["ops"][op][impl][nbytes] for r in ranks)}
                   for impl in IMPLS}
            rows.append({"size": nbytes, "count": nbytes // 4, "dtype": "float", "results": res})
        complete(rows, op, args.np)
        out["tables"][op] = rows
        print(format_table(rows, IMPLS, [("hvs", "gloo"), ("hvs", "hvd")],
                           f"{TITLES[op]}, CPU float32, {where}; best of {args.reps} runs per "
                           "size; ratios: busbw a / busbw b (above 1: a is faster)"))
        print()
    if spec["train"]:
        width, params = args.width, args.layers * (args.width * args.width + args.width)
        print(f"# training step of a {args.layers}-layer MLP of width {width} ({params / 1e6:.0f}M "
              f"parameters), batch {args.batch}, {where}; {args.steps} steps each, interleaved")
        med = {}
        for name in ranks[0]["train"]:
            per_step = [max(r["train"][name][i] for r in ranks) for i in range(args.steps)]
            med[name] = (statistics.median(per_step), min(per_step))
        print(f"# {'impl':>11} {'median(ms)':>11} {'best(ms)':>9} {'vs gloo':>8} "
              f"{'beyond none':>12} {'vs gloo':>8}")
        floor = med["none"][0]
        for name, (m, b) in med.items():
            if name == "none":
                print(f"  {name:>11} {m * 1e3:>11.1f} {b * 1e3:>9.1f}")
                continue
            gloo = med[f"{name.split('-')[0]}-gloo"][0]
            print(f"  {name:>11} {m * 1e3:>11.1f} {b * 1e3:>9.1f} {m / gloo:>7.2f}x "
                  f"{(m - floor) * 1e3:>12.1f} {(m - floor) / (gloo - floor):>7.2f}x")
        out["train"] = {name: {"median_s": m, "best_s": b} for name, (m, b) in med.items()}
    print(f"# load average {before} -> {load()}; {time.perf_counter() - t0:.0f} s")
    path = write_json("c10d_backend", out)
    print(f"# JSON: {os.path.relpath(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
