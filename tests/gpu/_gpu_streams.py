"""hvd ops on CUDA tensors produced and consumed on a side stream (`torch.cuda.stream(s)`).

Run directly (a world of one) or as every rank of `python -m collectives.launch -n N`.
Every producer below is held back by a GPU sleep of about 0.1 s on the side
stream, so an op that does not wait for the side stream reads the tensor
before it is written, and a consumer that does not wait for the op reads its
result before it is reduced.  Checks: one out-of-place allreduce; a fused
group of async in-place averages with prescale (several tensors, one device
fusion buffer); allgather and broadcast; three rounds, since the first
allocations of a round may synchronize the whole device and hide a race.  Prints "GPU STREAMS OK rank r/n".
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import horovod_spark.torch as hvd  # noqa: E402

SLEEP = 200_000_000  # GPU clock cycles: about 0.1 s


def _eq(t, want, what):
    got, want = t.float().cpu().reshape(-1), want.float().reshape(-1)
    bad = (got != want).nonzero()
    assert got.shape == want.shape and not len(bad), \
        f"rank {hvd.rank()}: {what}: {len(bad)} of {len(want)} elements differ, first at " \
        f"{bad[0].item() if len(bad) else '-'}: got {got[bad[0]].item() if len(bad) else got.shape}, " \
        f"want {want[bad[0]].item() if len(bad) else want.shape}"


def _round(rank: int, size: int, side, k: int) -> None:
    total = size * (size + 1) / 2 + size * k
    with torch.cuda.stream(side):
        x = torch.zeros(1 << 22, device="cuda")
        torch.cuda._sleep(SLEEP)
        x.fill_(rank + 1.0 + k)
        y = hvd.allreduce(x, op=hvd.Sum, name=f"streams.one.{k}")
        z = y * 2  # a consumer on the side stream
    side.synchronize()
    _eq(y, torch.full((1 << 22,), total), "out-of-place allreduce")
    _eq(z, torch.full((1 << 22,), 2 * total), "consumer of the allreduce")

    counts = (1, 17, 1000, 300_001)
    with torch.cuda.stream(side):
        ts = [torch.zeros(n, device="cuda") for n in counts]
        torch.cuda._sleep(SLEEP)
        for i, t in enumerate(ts):
            t.fill_(rank * 10.0 + i)
        handles = [hvd.allreduce_async_(t, op=hvd.Average, prescale_factor=2.0, name=f"streams.g{i}.{k}")
                   for i, t in enumerate(ts)]
        for h in handles:
            hvd.synchronize(h)
        after = [t + 1 for t in ts]
    side.synchronize()
    mean = 10.0 * (size - 1) / 2
    for i, (t, a) in enumerate(zip(ts, after)):
        _eq(t, torch.full((counts[i],), 2 * (mean + i)), f"fused average, tensor {i}")
        _eq(a, torch.full((counts[i],), 2 * (mean + i) + 1), f"consumer of fused tensor {i}")

    with torch.cuda.stream(side):
        g = torch.zeros(3, 5, device="cuda")
        b = torch.zeros(1 << 20, device="cuda")
        torch.cuda._sleep(SLEEP)
        g.fill_(float(rank))
        b.fill_(7.0 if rank == 0 else -1.0)
        gathered = hvd.allgather(g, name=f"streams.gather.{k}")
        hvd.broadcast_(b, root_rank=0, name=f"streams.bcast.{k}")
        b2 = b * 1
    side.synchronize()
    _eq(gathered, torch.arange(size, dtype=torch.float32).repeat_interleave(3)[:, None].expand(-1, 5),
        "allgather")
    _eq(b2, torch.full((1 << 20,), 7.0), "broadcast")


def main() -> int:
    hvd.init()
    torch.cuda.set_device(hvd.local_rank())
    rank, size = hvd.rank(), hvd.size()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    for k in range(3):  # later rounds reuse cached memory: no allocation syncs the device
        _round(rank, size, side, k)
    print(f"GPU STREAMS OK rank {rank}/{size}", flush=True)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
