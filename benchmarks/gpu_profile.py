"""Where the time of hvd ops on CUDA tensors goes, on one GPU (a world of one): cProfile.

    python benchmarks/gpu_profile.py [--ops 300]

Two patterns: a synchronous `hvd.allreduce_` of a 4 KiB tensor, and 161 async
`allreduce_async_` (ResNet-50's parameter shapes) then `synchronize`.  Prints
the time per op against torch.distributed's all_reduce and the top functions
by own time, so the per-op cost of our path can be read function by function.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", type=int, default=300)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    import torch
    import torch.distributed as dist

    import horovod_spark.torch as hvd
    from gpu import _free_port, resnet50_shapes

    hvd.init()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    t = torch.ones(1024, device="cuda")
    grads = [torch.ones(s, device="cuda") for s in resnet50_shapes()]

    def sync_op():
        hvd.allreduce_(t, op=hvd.Sum, name="p.one")

    def resnet():
        hs = [hvd.allreduce_async_(g, op=hvd.Sum, name=f"p.g{i}") for i, g in enumerate(grads)]
        for h in hs:
            hvd.synchronize(h)

    def timed(fn, n):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e6

    print(f"torch all_reduce 4 KiB  {timed(lambda: dist.all_reduce(t), args.ops):8.1f} us/op")
    print(f"hvd allreduce_ 4 KiB    {timed(sync_op, args.ops):8.1f} us/op")
    n_res = max(3, args.ops // 30)
    print(f"hvd 161 async + sync    {timed(resnet, n_res) / len(grads):8.1f} us/tensor")
    for what, fn, n in (("sync allreduce_", sync_op, args.ops), ("161 async", resnet, n_res)):
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
        print(f"\n## {what}, {n} rounds: top {args.top} by own time\n" + out.getvalue()[-6000:])
    dist.destroy_process_group()
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
