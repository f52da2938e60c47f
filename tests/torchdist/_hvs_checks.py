"""What the "hvs" backend tests run on every rank: each c10d op on an hvs group and on a
Gloo group over the same ranks and inputs, and training runs to compare.

A *check* returns a list of disagreements (empty: hvs gave Gloo's answer, or, where Gloo
refuses the op or dtype, numpy's).  Inputs come from the rank and a seed, so every rank
builds the same ones for its peers.  Pickled by value (see the bottom).
"""
from __future__ import annotations

import os
import sys

import cloudpickle

DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "int32",
          "int64", "bool")
OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")


def _input(dtype, rank, n=7, shift=0):
    import torch

    g = torch.Generator().manual_seed(100 * rank + shift)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.rand(n, generator=g) * 4 - 2).to(dtype)
    return torch.randint(1, 4, (n,), generator=g).to(dtype)


def _groups():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return dist.group.WORLD, dist.new_group(backend="hvs")


def _same(a, b, where, out):
    import torch

    if a is None:
        return
    close = torch.equal(a, b) if not a.is_floating_point() else \
        torch.allclose(a.float(), b.float(), rtol=1e-2 if a.element_size() == 2 else 1e-6,
                       atol=1e-2 if a.element_size() == 2 else 1e-6)
    if not close:
        out.append(f"{where}: gloo {a.tolist()} hvs {b.tolist()}")


def _both(fn, gloo, hvs):
    """fn(group) on Gloo (None where Gloo refuses it) and on hvs."""
    try:
        theirs = fn(gloo)
    except (RuntimeError, ValueError):
        theirs = None
    return theirs, fn(hvs)


def allreduce_every_op_and_dtype():
    import torch
    import torch.distributed as dist

    gloo, hvs = _groups()
    rank, out = dist.get_rank(), []
    for dname in DTYPES:
        dtype = getattr(torch, dname)
        for opname in OPS:
            op = getattr(dist.ReduceOp, opname)
            bitwise = opname in ("BAND", "BOR", "BXOR")
            if bitwise and dtype.is_floating_point or opname == "AVG" and not dtype.is_floating_point:
                continue
            if dtype == torch.bool and opname in ("SUM", "AVG", "PRODUCT"):
                continue

            def run(group, dtype=dtype, op=op):
                t = _input(dtype, rank)
                dist.all_reduce(t, op=op, group=group)
                return t
            theirs, mine = _both(run, gloo, hvs)
            if opname == "AVG":  # Gloo has no AVG: its SUM over the world
                sums = _input(dtype, rank).double() * 0
                for r in range(dist.get_world_size()):
                    sums += _input(dtype, r).double()
                theirs = (sums / dist.get_world_size()).to(dtype)
            _same(theirs, mine, f"all_reduce {opname} {dname}", out)
    dist.destroy_process_group()
    return out


def every_other_op():
    import torch
    import torch.distributed as dist

    gloo, hvs = _groups()
    rank, size, out = dist.get_rank(), dist.get_world_size(), []
    for dname in ("float32", "bfloat16", "int64", "uint8"):
        dtype = getattr(torch, dname)

        def bcast(group):
            t = _input(dtype, rank)
            dist.broadcast(t, src=size - 1, group=group)
            return t

        def gather_list(group):
            outs = [torch.zeros(7, dtype=dtype) for _ in range(size)]
            dist.all_gather(outs, _input(dtype, rank), group=group)
            return torch.cat(outs)

        def gather_tensor(group):
            o = torch.zeros(7 * size, dtype=dtype)
            dist.all_gather_into_tensor(o, _input(dtype, rank), group=group)
            return o

        def rs_tensor(group):
            o = torch.zeros(3, dtype=dtype)
            dist.reduce_scatter_tensor(o, _input(dtype, rank, 3 * size), group=group)
            return o

        def rs_list(group):
            o = torch.zeros(3, dtype=dtype)
            dist.reduce_scatter(o, list(_input(dtype, rank, 3 * size).chunk(size)), group=group)
            return o

        def reduce_root(group):
            t = _input(dtype, rank)
            dist.reduce(t, dst=0, group=group)
            return t if rank == 0 else torch.zeros(0)

        def gather_root(group):
            outs = [torch.zeros(7, dtype=dtype) for _ in range(size)] if rank == 1 else None
            dist.gather(_input(dtype, rank), outs, dst=1, group=group)
            return torch.cat(outs) if rank == 1 else torch.zeros(0)

        def scatter_root(group):
            o = torch.zeros(7, dtype=dtype)
            ins = [_input(dtype, r, shift=5) for r in range(size)] if rank == 0 else None
            dist.scatter(o, ins, src=0, group=group)
            return o

        def a2a_single(group):
            o = torch.zeros(2 * size, dtype=dtype)
            dist.all_to_all_single(o, _input(dtype, rank, 2 * size), group=group)
            return o

        def a2a_uneven(group):
            splits_in = [(rank + r) % 3 + 1 for r in range(size)]
            splits_out = [(r + rank) % 3 + 1 for r in range(size)]
            o = torch.zeros(sum(splits_out), dtype=dtype)
            dist.all_to_all_single(o, _input(dtype, rank, sum(splits_in)), splits_out, splits_in,
                                   group=group)
            return o

        for name, fn in (("broadcast", bcast), ("all_gather", gather_list),
                         ("all_gather_into_tensor", gather_tensor),
                         ("reduce_scatter_tensor", rs_tensor), ("reduce_scatter", rs_list),
                         ("reduce", reduce_root), ("gather", gather_root),
                         ("scatter", scatter_root), ("all_to_all_single", a2a_single),
                         ("all_to_all_single uneven", a2a_uneven)):
            theirs, mine = _both(fn, gloo, hvs)
            _same(theirs, mine, f"{name} {dname}", out)
    # a non-contiguous tensor, reduced in place (Gloo reduces its storage's first elements
    # instead, so the answer is the sum of the views)
    t = _input(torch.float64, rank, 14)[::2]
    dist.all_reduce(t, group=hvs)
    want = sum(_input(torch.float64, r, 14)[::2] for r in range(size))
    _same(want, t, "all_reduce of a strided view", out)
    # point to point, in a ring, and a barrier
    send, recv = torch.full((5,), float(rank)), torch.zeros(5)
    if rank % 2 == 0:
        dist.send(send, (rank + 1) % size, group=hvs)
        dist.recv(recv, (rank - 1) % size, group=hvs)
    else:
        dist.recv(recv, (rank - 1) % size, group=hvs)
        dist.send(send, (rank + 1) % size, group=hvs)
    if recv.tolist() != [float((rank - 1) % size)] * 5:
        out.append(f"recv on rank {rank}: {recv.tolist()}")
    dist.barrier(group=hvs)
    dist.destroy_process_group()
    return out


def agree_with_gloo():
    """Every op's disagreements with Gloo, in one job: all_reduce's, then the others'."""
    return allreduce_every_op_and_dtype() + every_other_op()


def subgroups():
    """new_group over ranks 0 and the last, and over the others: each sums its own ranks."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("hvs")
    rank, size = dist.get_rank(), dist.get_world_size()
    ends = [0, size - 1]
    middle = [r for r in range(size) if r not in ends]
    ends_group = dist.new_group(ends)
    middle_group = dist.new_group(middle) if middle else None
    t = torch.tensor([float(rank + 1)])
    if rank in ends:
        dist.all_reduce(t, group=ends_group)
        want = sum(r + 1 for r in ends)
    elif middle_group is not None:
        dist.all_reduce(t, group=middle_group)
        want = sum(r + 1 for r in middle)
    world = torch.tensor([1.0])
    dist.all_reduce(world)  # the world group still works after its subgroups did
    dist.destroy_process_group()
    return t.item() == want and world.item() == size


def unsupported():
    """A receive from any source: refused, naming what to do instead."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("hvs")
    try:
        dist.recv(torch.zeros(2))
        said = "no error"
    except Exception as exc:  # noqa: BLE001 (the test reads the type and message)
        said = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    dist.destroy_process_group()
    return said


def async_work_chains_a_future():
    """async_op=True: a Work whose future a comm hook can chain, as DDP's do."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("hvs")
    t = torch.ones(4) * (dist.get_rank() + 1)
    work = dist.all_reduce(t, async_op=True)
    chained = work.get_future().then(lambda fut: fut.value()[0] * 10)
    got = chained.wait().tolist()
    work.wait()
    dist.destroy_process_group()
    return got


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


def train(backend: str, kind: str, steps: int = 4):
    """DDP or FSDP2 (`kind`) over `backend`: the full weights after `steps` steps."""
    import torch
    import torch.distributed as dist

    dist.init_process_group(backend)
    rank = dist.get_rank()
    model = _model()
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        # a tiny bucket cap: several buckets, reduced while backward still runs
        model = DDP(model, bucket_cap_mb=0.002)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        g = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randn(16, 32, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    state = model.module.state_dict() if kind == "ddp" else \
        {k: v.full_tensor() for k, v in model.state_dict().items()}
    weights = {k: v.flatten().tolist() for k, v in state.items()}
    del model
    dist.destroy_process_group()
    return weights


def leaves_nothing():
    """init, an op, destroy: the threads, sockets and /dev/shm entries as before."""
    import threading

    import psutil
    import torch
    import torch.distributed as dist

    proc = psutil.Process()
    import horovod_spark.torch.c10d  # noqa: F401  (before the count: its import starts nothing)
    before = (threading.active_count(), len(proc.net_connections()), len(os.listdir("/dev/shm")))
    for _ in range(2):
        dist.init_process_group("hvs")
        t = torch.ones(1 << 16)
        dist.all_reduce(t)
        dist.destroy_process_group()
    import time

    deadline = time.monotonic() + 5
    while True:
        after = (threading.active_count(), len([c for c in proc.net_connections()
                                                if c.status != "TIME_WAIT"]),
                 len(os.listdir("/dev/shm")))
        if after == before or time.monotonic() > deadline:
            return before, after
        time.sleep(0.05)


def mismatch():
    """Rank 0 reduces 4 elements, the others 8: what each rank's all_reduce raises."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("hvs")
    t = torch.ones(4 if dist.get_rank() == 0 else 8)
    try:
        dist.all_reduce(t)
        return "no error"
    except Exception as exc:  # noqa: BLE001 (the test reads the type and message)
        return f"{type(exc).__name__}: {exc}"


def one_rank_dies(victim: int = 1):
    """Rank `victim` is SIGKILLed at its 4th all_reduce: what the others' all_reduce raises."""
    import signal

    import torch
    import torch.distributed as dist

    dist.init_process_group("hvs")
    t = torch.ones(1 << 20)
    try:
        for step in range(100):
            if dist.get_rank() == victim and step == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            dist.all_reduce(t)
        return "survived"
    except Exception as exc:  # noqa: BLE001 (the test reads the type and message)
        return f"{type(exc).__name__}: {exc}"


def main() -> None:
    """Under torchrun or any env:// launcher: `python _hvs_checks.py CHECK [ARG...] OUT`;
    the check's result, as JSON, in OUT.RANK.  "hvs" registered by the import, as a user's
    script would."""
    import json

    import horovod_spark.torch  # noqa: F401

    name, *args, out = sys.argv[1:]
    result = globals()[name](*args)
    with open(f"{out}.{os.environ['RANK']}", "w") as f:
        json.dump(result, f)
    os._exit(0)  # torch 2.13's teardown aborts now and then; the result is written


if __name__ == "__main__":
    main()
else:
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
