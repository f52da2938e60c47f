"""Our NCCL path vs torch.distributed NCCL on the same CUDA tensors, in one run.

    python benchmarks/gpu.py                 # one GPU, world of one
    python benchmarks/gpu.py --np 2          # N GPUs: launches itself with collectives.launch
    python -m collectives.launch -n 2 --hosts a,b tests/gpu/_shared_gpu.py benchmarks/gpu.py --np 2
                                             # 2 ranks on one GPU, NCCL's socket transport

Part 1, allreduce (SUM, float32, in place) of one tensor per size, 4 KiB..256 MiB:
  torch    torch.distributed.all_reduce(t)               (raw NCCL through torch)
  backend  NcclBackend.allreduce_tensor(t, t)            (our backend, no front end)
  comm     Communicator.allreduce(t, out=t)              (our front end + backend)
  hvd      horovod_spark.torch.allreduce_(t, op=Sum)     (through the fusion engine)
Part 2, a ResNet-50 gradient set (161 tensors, 25.6 M float32, ~97.5 MiB), summed:
  torch flat       one all_reduce of one flat buffer of the same size (the floor)
  torch per-tensor one all_reduce per tensor
  torch buckets    DDP-style 25 MiB buckets: flatten, all_reduce, copy back
  hvd fused        allreduce_async_ per tensor, then synchronize (our fusion engine)
  comm flat        Communicator.allreduce of the flat buffer
Part 3, a training step of a model with ResNet-50's parameters (zero_grad, backward,
SGD step): torch alone, DDP, hvd.DistributedOptimizer (bucket views; default runs,
and one bucket).
Times are medians over reps of the mean over `iters` calls, each rep ending in
torch.cuda.synchronize(), the slowest rank's; sides take turns rep by rep.
algbw = bytes / time; busbw = algbw * 2(n-1)/n (nccl-tests), which is 0 for one
rank: a world of one moves no data (NCCL returns at once for an in-place op),
so there the columns "+us" (ours minus torch, microseconds per op) are what
our path costs on top of the enqueue.  Two ranks sharing one GPU (each its own
NCCL host) run real transfers, over sockets, so the ratios mean something there.
Target: comm and hvd within 5% of torch at 64 MiB.  JSON goes to
benchmarks/results/gpu.json (and to $OUT/gpu.json when $OUT is set).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time


REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, REPO)


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=1, help="ranks, one per GPU (default 1)")
    p.add_argument("--min", type=int, default=4 << 10, help="smallest size, bytes")
    p.add_argument("--max", type=int, default=256 << 20, help="largest size, bytes")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--parts", default="sizes,resnet,training",
                   help="which parts to run, comma-separated (default: all three)")
    p.add_argument("--json", default=os.path.join(REPO, "benchmarks", "results", "gpu.json"))
    return p.parse_args(argv)


def resnet50_shapes() -> list:
    """Parameter shapes of torchvision's resnet50 (1000 classes), in registration order."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            shapes += [(planes, inplanes, 1, 1), (planes,), (planes,),
                       (planes, planes, 3, 3), (planes,), (planes,),
                       (planes * 4, planes, 1, 1), (planes * 4,), (planes * 4,)]
            if b == 0:
                shapes += [(planes * 4, inplanes, 1, 1), (planes * 4,), (planes * 4,)]
            inplanes = planes * 4
    return shapes + [(1000, 2048), (1000,)]


class Bench:
    def __init__(self, args) -> None:
        import torch
        import torch.distributed as dist

        import horovod_spark.torch as hvd
        from horovod_spark.torch import _state

        hvd.init()
        self.hvd, self.torch, self.dist, self.args = hvd, torch, dist, args
        self.comm = _state.communicator()
        self.rank, self.size = hvd.rank(), hvd.size()
        torch.cuda.set_device(hvd.local_rank())
        self.dev = torch.device("cuda", hvd.local_rank())
        # CPU exchanges go through hvd's ops: the engine's thread uses the communicator's CPU
        # path in the background, so a direct comm call beside it would interleave with it.
        port = hvd.broadcast_object(_free_port() if self.rank == 0 else 0, root_rank=0)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{int(port)}",
                                rank=self.rank, world_size=self.size)
        warm = torch.ones(1, device=self.dev)
        self.comm.allreduce(warm, out=warm)  # creates the communicator's NCCL backend
        self.backend = getattr(self.comm, "_gpu", None)  # private: the bare backend, for one column
        assert self.backend is not None and self.backend.name == "nccl", self.backend

    def _sync(self) -> None:
        self.torch.cuda.synchronize()

    def _time(self, fn, iters: int) -> float:
        self._sync()
        self.dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        self._sync()
        return (time.perf_counter() - t0) / iters

    def measure(self, sides: dict, iters: int) -> dict:
        for fn in sides.values():
            fn()
        names = list(sides)
        times: dict = {k: [] for k in names}
        for rep in range(self.args.reps):
            for k in names[rep % len(names):] + names[:rep % len(names)]:
                times[k].append(self._time(sides[k], iters))
        med = self.torch.tensor([statistics.median(times[k]) for k in names], dtype=self.torch.float64)
        worst = self.hvd.allreduce(med, op=self.hvd.Max, name="bench.worst")  # the slowest rank's
        return {k: float(t) for k, t in zip(names, worst)}

    def sizes(self) -> list:
        from collectives.types import DType, ReduceOp

        hvd, rows, nbytes = self.hvd, [], self.args.min
        while nbytes <= self.args.max:
            t = self.torch.ones(nbytes // 4, device=self.dev)
            sides = {
                "torch": lambda: self.dist.all_reduce(t),
                "backend": lambda: self.backend.allreduce_tensor(t, t, DType.FLOAT32, ReduceOp.SUM),
                "comm": lambda: self.comm.allreduce(t, out=t),
                "hvd": lambda: hvd.allreduce_(t, op=hvd.Sum, name=f"bench.{nbytes}"),
            }
            iters = max(5, min(200, (1 << 30) // nbytes // 8))
            rows.append({"size": nbytes, "count": nbytes // 4, "iters": iters,
                         **self.measure(sides, iters)})
            nbytes *= 4
        return rows

    def resnet(self) -> dict:
        torch, dist, hvd = self.torch, self.dist, self.hvd
        grads = [torch.ones(s, device=self.dev) for s in resnet50_shapes()]
        total = sum(g.numel() for g in grads)
        flat = torch.ones(total, device=self.dev)
        buckets = _buckets(grads, 25 << 20)

        def per_tensor():
            for g in grads:
                dist.all_reduce(g)

        def bucketed():
            for b in buckets:
                buf = torch.cat([g.reshape(-1) for g in b])
                dist.all_reduce(buf)
                off = 0
                for g in b:
                    g.copy_(buf[off:off + g.numel()].view_as(g))
                    off += g.numel()

        def fused():
            hs = [hvd.allreduce_async_(g, op=hvd.Sum, name=f"grad.{i}") for i, g in enumerate(grads)]
            for h in hs:
                hvd.synchronize(h)

        sides = {"torch flat": lambda: dist.all_reduce(flat), "torch per-tensor": per_tensor,
                 "torch buckets": bucketed, "hvd fused": fused,
                 "comm flat": lambda: self.comm.allreduce(flat, out=flat)}
        return {"tensors": len(grads), "elements": total, "bytes": total * 4,
                **self.measure(sides, 5)}


    def training(self) -> dict:
        """One training step of a model with ResNet-50's parameters (forward and backward
        cost almost nothing, so the step is the gradients' reduction and SGD's update):
        plain torch on one GPU (the floor), DDP, and hvd.DistributedOptimizer."""
        torch, hvd = self.torch, self.hvd

        class Params(torch.nn.Module):
            def __init__(self, dev):
                super().__init__()
                self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(s, device=dev))
                                                 for s in resnet50_shapes())

            def forward(self, x):  # (DDP wants an input)
                return sum(p.sum() for p in self.ps) * x

        one = torch.ones((), device=self.dev)

        def stepper(model, opt):
            def step():
                opt.zero_grad()
                model(one).backward()
                opt.step()
            return step

        def sgd(model):
            return torch.optim.SGD(model.parameters(), lr=0.0)

        local = Params(self.dev)
        ddp_model = torch.nn.parallel.DistributedDataParallel(Params(self.dev),
                                                              device_ids=[self.dev.index])
        ours, ours1 = Params(self.dev), Params(self.dev)
        sides = {
            "torch local": stepper(local, sgd(local)),
            "torch DDP": stepper(ddp_model, sgd(ddp_model)),
            "hvd optimizer": stepper(ours, hvd.DistributedOptimizer(
                sgd(ours), named_parameters=ours.named_parameters())),
            "hvd one bucket": stepper(ours1, hvd.DistributedOptimizer(
                sgd(ours1), named_parameters=ours1.named_parameters(), num_groups=1)),
        }
        return self.measure(sides, 5)


def _buckets(tensors, limit: int) -> list:
    out, cur, size = [], [], 0
    for t in reversed(tensors):  # gradients arrive last layer first
        cur.append(t)
        size += t.numel() * 4
        if size >= limit:
            out.append(cur)
            cur, size = [], 0
    return out + ([cur] if cur else [])


def _nccl_version(torch) -> str:
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mode(size: int) -> str:
    if size == 1:
        return "one rank"
    if os.environ.get("NCCL_HOSTID"):
        return f"{size} ranks sharing one GPU, each its own NCCL host (socket transport)"
    return f"{size} ranks, one GPU each"


def _report_sizes(rows: list, size: int) -> str:
    bus = 2 * (size - 1) / size
    lines = [f"# allreduce SUM float32 in place, {_mode(size)}; time us, algbw/busbw GB/s; "
             "ratio = ours / torch; +us = ours - torch",
             f"{'size(B)':>11} {'count':>10} " + " ".join(
                 f"{k + ' us':>11} {'algbw':>7} {'busbw':>7}" for k in ("torch", "backend", "comm", "hvd"))
             + f" {'comm/t':>7} {'hvd/t':>7} {'comm+us':>8} {'hvd+us':>8}"]
    for r in rows:
        cells = [f"{r['size']:>11}", f"{r['count']:>10}"]
        for k in ("torch", "backend", "comm", "hvd"):
            alg = r["size"] / r[k] / 1e9
            cells += [f"{r[k] * 1e6:>11.1f}", f"{alg:>7.2f}", f"{alg * bus:>7.2f}"]
        cells += [f"{r['comm'] / r['torch']:>7.3f}", f"{r['hvd'] / r['torch']:>7.3f}",
                  f"{(r['comm'] - r['torch']) * 1e6:>8.1f}", f"{(r['hvd'] - r['torch']) * 1e6:>8.1f}"]
        lines.append(" ".join(cells))
    return "\n".join(lines)


def _report_resnet(resnet: dict) -> str:
    lines = [f"# ResNet-50 gradient set: {resnet['tensors']} tensors, {resnet['elements']} "
             f"float32 ({resnet['bytes'] / 2**20:.1f} MiB), SUM; overhead vs one flat torch all_reduce"]
    floor = resnet["torch flat"]
    for k in ("torch flat", "torch per-tensor", "torch buckets", "hvd fused", "comm flat"):
        lines.append(f"{k:>17} {resnet[k] * 1e3:>9.3f} ms  {resnet['bytes'] / resnet[k] / 1e9:>7.2f} GB/s"
                     f"  overhead {100 * (resnet[k] / floor - 1):+6.1f}%"
                     f"  {(resnet[k] - floor) * 1e6:+9.1f} us")
    return "\n".join(lines)


def _report_training(training: dict) -> str:
    lines = ["# a training step (zero_grad, backward, SGD step) of a model with ResNet-50's "
             "parameters; vs DDP"]
    for k, t in training.items():
        lines.append(f"{k:>17} {t * 1e3:>9.3f} ms  / DDP {t / training['torch DDP']:6.3f}")
    return "\n".join(lines)


def _child(args) -> int:
    """Each part is printed (rank 0) as soon as it is measured, and the JSON rewritten, so a
    run cut short by its time limit still reports the parts it finished."""
    b = Bench(args)
    blob = {"benchmark": "gpu", "ranks": b.size, "device": b.torch.cuda.get_device_name(),
            "nccl": _nccl_version(b.torch), "mode": _mode(b.size)}
    paths = [args.json] + ([os.path.join(os.environ["OUT"], os.path.basename(args.json))]
                           if os.environ.get("OUT") else [])
    parts = {"sizes": ("allreduce", b.sizes, lambda r: _report_sizes(r, b.size)),
             "resnet": ("resnet50", b.resnet, _report_resnet),
             "training": ("training_step", b.training, _report_training)}
    for part in args.parts.split(","):
        key, run, report = parts[part.strip()]
        t0 = time.perf_counter()
        blob[key] = run()
        if b.rank == 0:
            print(f"{report(blob[key])}\n({part}: {time.perf_counter() - t0:.1f} s)\n", flush=True)
            for path in paths:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w") as f:
                    json.dump(blob, f, indent=1)
    b.dist.destroy_process_group()
    b.hvd.shutdown()
    return 0


def main() -> int:
    args = _args()
    import torch

    if not torch.cuda.is_available():
        print(f"benchmarks/gpu.py needs a CUDA GPU; torch {torch.__version__} sees none")
        return 2
    if args.np > 1 and "HVS_RANK" not in os.environ:
        cmd = [sys.executable, "-m", "collectives.launch", "-n", str(args.np), __file__, *sys.argv[1:]]
        return subprocess.call(cmd, cwd=REPO)
    return _child(args)


if __name__ == "__main__":
    sys.exit(main())
