"""Checks of `horovod_spark.torch`'s ops, run inside every rank of one launch.

`run_all()` returns {check name: "ok" or the failure text}.  Inputs are
seeded by rank, so every rank computes the expected values with numpy.
"""
from __future__ import annotations

import os
import re

import numpy as np
import torch

from _torch_support import run_checks

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32,
          torch.int64, torch.uint8)


def data(rank: int, shape, dtype, tag: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * tag + rank)
    if dtype.is_floating_point:
        return (torch.rand(shape, generator=g, dtype=torch.float64) * 4 - 2).to(dtype)
    return torch.randint(1, 4, shape, generator=g).to(dtype)


def want(size: int, shape, dtype, op: str, tag: int = 0) -> np.ndarray:
    xs = np.stack([data(r, shape, dtype, tag).double().numpy() for r in range(size)])
    if op == "avg":
        out = xs.mean(0)
        return np.trunc(xs.sum(0) / size) if not dtype.is_floating_point else out
    return {"sum": xs.sum(0), "min": xs.min(0), "max": xs.max(0), "prod": xs.prod(0)}[op]


def close(got: torch.Tensor, expected, dtype) -> None:
    tol = {torch.float16: 2e-2, torch.bfloat16: 5e-2, torch.float32: 1e-5}.get(dtype, 1e-9)
    np.testing.assert_allclose(got.double().numpy(), expected, rtol=tol, atol=tol * 4)


def placement_matches_the_launcher(hvd):
    assert hvd.is_initialized()
    assert hvd.rank() == int(os.environ["HVS_RANK"]) and hvd.size() == int(os.environ["HVS_SIZE"])
    assert hvd.local_rank() == int(os.environ["HVS_LOCAL_RANK"])
    assert hvd.local_size() == int(os.environ["HVS_LOCAL_SIZE"])
    assert (hvd.cross_rank(), hvd.cross_size()) == (0, 1)
    assert hvd.is_homogeneous() and hvd.mpi_threads_supported() and not hvd.gloo_enabled()


def allreduce_of_every_op_and_dtype_matches_numpy(hvd):
    ops = {"sum": hvd.Sum, "avg": hvd.Average, "min": hvd.Min, "max": hvd.Max, "prod": hvd.Product}
    r, n = hvd.rank(), hvd.size()
    for dtype in DTYPES:
        for key, op in ops.items():
            shape, tag = (3, 5), DTYPES.index(dtype)
            x = data(r, shape, dtype, tag)
            got = hvd.allreduce(x, op=op, name=f"ar.{dtype}.{key}")
            assert got.dtype == dtype and got.shape == x.shape, (got.dtype, got.shape)
            close(got, want(n, shape, dtype, key, tag), dtype)
            close(x, data(r, shape, dtype, tag).double().numpy(), dtype)  # input untouched
            y = x.clone()
            assert hvd.allreduce_(y, op=op) is y  # unnamed: matched by call order
            close(y, want(n, shape, dtype, key, tag), dtype)


def async_variants_and_scale_factors_match_numpy(hvd):
    r, n = hvd.rank(), hvd.size()
    xs = [data(r, (17,), torch.float32, tag=i) for i in range(6)]
    hs = [hvd.allreduce_async(x, name=f"async.{i}", prescale_factor=2.0, postscale_factor=0.25)
          for i, x in enumerate(xs)]
    ys = [x.clone() for x in xs]
    hs_ = [hvd.allreduce_async_(y, name=f"async_.{i}", op=hvd.Sum) for i, y in enumerate(ys)]
    for i in range(6):
        close(hvd.synchronize(hs[i]), want(n, (17,), torch.float32, "avg", i) * 0.5, torch.float32)
        assert hvd.poll(hs_[i]) in (True, False)
        assert hvd.synchronize(hs_[i]) is ys[i]
        close(ys[i], want(n, (17,), torch.float32, "sum", i), torch.float32)
        assert hvd.poll(hs[i])
    legacy = hvd.allreduce(torch.ones(2), average=False)
    assert (legacy == n).all()


def grouped_allreduce_of_mixed_dtypes_matches_numpy(hvd):
    r, n = hvd.rank(), hvd.size()
    ts = [data(r, (4,), torch.float32, 1), data(r, (2, 3), torch.float64, 2), data(r, (5,), torch.int64, 3)]
    outs = hvd.grouped_allreduce(ts, op=hvd.Sum, name="grouped")
    for t, o, tag in zip(ts, outs, (1, 2, 3)):
        close(o, want(n, tuple(t.shape), t.dtype, "sum", tag), t.dtype)
    copies = [t.clone() for t in ts]
    assert all(a is b for a, b in zip(hvd.grouped_allreduce_(copies, op=hvd.Max), copies))
    h = hvd.grouped_allreduce_async([t.double() for t in ts[:2]])
    for o, t, tag in zip(hvd.synchronize(h), ts[:2], (1, 2)):
        close(o, want(n, tuple(t.shape), t.dtype, "avg", tag), torch.float64)


def allgather_with_different_first_dims_matches_numpy(hvd):
    r, n = hvd.rank(), hvd.size()
    x = torch.full((r + 1, 2, 3), float(r))
    got = hvd.allgather(x, name="ag")
    assert got.shape == (sum(range(1, n + 1)), 2, 3), got.shape
    assert got[:, 0, 0].tolist() == [float(k) for k in range(n) for _ in range(k + 1)]
    ints = hvd.synchronize(hvd.allgather_async(torch.arange(r, dtype=torch.int32)))
    assert ints.tolist() == [i for k in range(n) for i in range(k)]
    halves = hvd.allgather(torch.full((2,), float(r)).bfloat16())
    assert halves.dtype == torch.bfloat16 and halves.float().tolist() == [float(k) for k in range(n) for _ in "ab"]


def broadcast_from_every_root_matches_numpy(hvd):
    r, n = hvd.rank(), hvd.size()
    for root in range(n):
        x = torch.full((3, 2), float(r))
        got = hvd.broadcast(x, root, name=f"bc.{root}")
        assert (got == root).all() and (x == r).all()
        y = torch.full((4,), r, dtype=torch.int64)
        assert hvd.broadcast_(y, root) is y and (y == root).all()
        z = torch.full((2,), float(r)).half()
        assert (hvd.synchronize(hvd.broadcast_async_(z, root)) == root).all()
        assert (hvd.synchronize(hvd.broadcast_async(torch.tensor([r]), root)) == root).all()


def alltoall_with_and_without_splits_matches_numpy(hvd):
    r, n = hvd.rank(), hvd.size()
    even = torch.arange(2 * n, dtype=torch.float32) + 100 * r
    got = hvd.alltoall(even, name="a2a.even")
    assert got.tolist() == [float(100 * k + 2 * r + i) for k in range(n) for i in range(2)]
    splits = [(r + j) % 2 + 1 for j in range(n)]
    src = torch.arange(sum(splits)) + 100 * r
    out, recv = hvd.alltoall(src, splits=splits, name="a2a.splits")
    assert recv.dtype == torch.int32 and recv.tolist() == [(k + r) % 2 + 1 for k in range(n)]
    expect = []
    for k in range(n):
        ks = [(k + j) % 2 + 1 for j in range(n)]
        expect += [100 * k + i for i in range(sum(ks[:r]), sum(ks[:r]) + ks[r])]
    assert out.tolist() == expect, (out.tolist(), expect)


def reducescatter_matches_numpy(hvd):
    r, n = hvd.rank(), hvd.size()
    shape = (2 * n + 1, 3)
    x = data(r, shape, torch.float64, 7)
    full = want(n, shape, torch.float64, "avg", 7)
    start = 0 if r == 0 else 3 + 2 * (r - 1)
    close(hvd.reducescatter(x), full[start:start + (3 if r == 0 else 2)], torch.float64)
    s = hvd.synchronize(hvd.reducescatter_async(x, op=hvd.Sum))
    close(s, full[start:start + (3 if r == 0 else 2)] * n, torch.float64)


def grouped_allgather_and_reducescatter_match_numpy(hvd):
    r, n = hvd.rank(), hvd.size()
    a, b = torch.full((r + 1, 2), float(r)), torch.arange(3, dtype=torch.int64) + 10 * r
    ga, gb = hvd.grouped_allgather([a, b], name="gag")
    assert ga[:, 0].tolist() == [float(k) for k in range(n) for _ in range(k + 1)]
    assert gb.tolist() == [10 * k + i for k in range(n) for i in range(3)]
    shape = (2 * n + 1, 3)
    xs = [data(r, shape, torch.float64, 11), data(r, shape, torch.float32, 12)]
    outs = hvd.grouped_reducescatter(xs, op=hvd.Sum)
    start, rows = (0, 3) if r == 0 else (3 + 2 * (r - 1), 2)
    for x, o, tag in zip(xs, outs, (11, 12)):
        close(o, want(n, shape, x.dtype, "sum", tag)[start:start + rows], x.dtype)
    try:  # dynamic process sets are off unless asked for, as in Horovod
        hvd.add_process_set([0])
    except ValueError as exc:
        assert "HOROVOD_DYNAMIC_PROCESS_SETS=1" in str(exc), exc
    else:
        raise AssertionError("add_process_set did not refuse")


def gradients_flow_through_allreduce_allgather_and_broadcast(hvd):
    r, n = hvd.rank(), hvd.size()
    a = torch.ones(3, requires_grad=True)
    (hvd.allreduce(a * (r + 1), op=hvd.Sum) * 2).sum().backward()
    assert a.grad.tolist() == [2.0 * (r + 1) * n] * 3, a.grad  # d/da of sum over ranks
    b = torch.ones(r + 1, 2, requires_grad=True)
    hvd.allgather(b).sum().backward()
    assert (b.grad == 1).all(), b.grad
    c = torch.ones(2, requires_grad=True)
    hvd.broadcast(c, 0).sum().backward()
    assert c.grad.tolist() == ([1.0, 1.0] if r == 0 else [0.0, 0.0]), c.grad


def fp16_compression_keeps_the_dtype_and_the_value(hvd):
    r, n = hvd.rank(), hvd.size()
    x = data(r, (64,), torch.float32, 9)
    got = hvd.allreduce(x, compression=hvd.Compression.fp16, op=hvd.Sum)
    assert got.dtype == torch.float32
    close(got.half(), want(n, (64,), torch.float32, "sum", 9), torch.float16)
    ints = hvd.allreduce(torch.tensor([r]), compression=hvd.Compression.fp16, op=hvd.Sum)
    assert ints.dtype == torch.int64 and ints.item() == sum(range(n))


def objects_and_parameters_broadcast_from_the_root(hvd):
    r, n = hvd.rank(), hvd.size()
    assert hvd.broadcast_object({"from": r, "list": [r] * 3}, root_rank=n - 1) == \
        {"from": n - 1, "list": [n - 1] * 3}
    assert hvd.allgather_object(("rank", r)) == [("rank", k) for k in range(n)]
    torch.manual_seed(r)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    states = hvd.allgather_object({k: v.clone() for k, v in model.state_dict().items()})
    for k, v in states[0].items():
        assert all(torch.equal(v, s[k]) for s in states), k
    torch.manual_seed(r + 10)
    other = torch.nn.Linear(2, 2)
    hvd.broadcast_parameters(other.named_parameters(), root_rank=n - 1)
    weights = hvd.allgather_object(other.weight.detach().clone())
    assert all(torch.equal(w, weights[-1]) for w in weights)


def optimizer_state_broadcasts_from_the_root(hvd):
    r = hvd.rank()
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1))
    if r == 0:
        model(torch.ones(4, 3)).sum().backward()
        opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == 0.01
    states = hvd.allgather_object(opt.state_dict())
    assert all(len(s["state"]) == 2 for s in states), [len(s["state"]) for s in states]
    for s in states:
        assert torch.equal(s["state"][0]["exp_avg"], states[0]["state"][0]["exp_avg"])


def a_mismatch_raises_on_every_rank_naming_the_tensor(hvd):
    r = hvd.rank()
    try:
        hvd.allreduce(torch.ones(2 + r), name="mm.torch")
    except hvd.MismatchError as exc:
        text = str(exc)
        assert "'allreduce.mm.torch'" in text and re.search(r"rank 1\b", text), text
        assert isinstance(exc, hvd.HorovodInternalError)
    else:
        raise AssertionError("no MismatchError")


def barrier_join_and_metrics_work(hvd):
    hvd.barrier()
    last = hvd.join()  # every rank joins at once here, so any rank may be the last
    assert isinstance(last, int) and 0 <= last < hvd.size(), last
    m = hvd.metrics(reset=True)
    assert m["bytes_reduced"] > 0 and m["tensors_reduced"] > 0 and "engine_cycles" in m, m
    assert hvd.metrics()["bytes_reduced"] == 0


def cuda_tensors_need_a_gpu(hvd):
    if not torch.cuda.is_available():
        return  # exercised on GPU machines only
    x = torch.ones(4, device="cuda") * (hvd.rank() + 1)
    got = hvd.allreduce(x, op=hvd.Sum)
    assert got.is_cuda and got.cpu().tolist() == [sum(range(1, hvd.size() + 1))] * 4


CHECKS = [placement_matches_the_launcher, allreduce_of_every_op_and_dtype_matches_numpy,
          async_variants_and_scale_factors_match_numpy, grouped_allreduce_of_mixed_dtypes_matches_numpy,
          allgather_with_different_first_dims_matches_numpy, broadcast_from_every_root_matches_numpy,
          alltoall_with_and_without_splits_matches_numpy, reducescatter_matches_numpy,
          grouped_allgather_and_reducescatter_match_numpy,
          gradients_flow_through_allreduce_allgather_and_broadcast,
          fp16_compression_keeps_the_dtype_and_the_value, objects_and_parameters_broadcast_from_the_root,
          optimizer_state_broadcasts_from_the_root, a_mismatch_raises_on_every_rank_naming_the_tensor,
          barrier_join_and_metrics_work, cuda_tensors_need_a_gpu]


def run_all() -> dict:
    torch.set_num_threads(1)
    import horovod_spark.torch as hvd
    results = {}
    try:
        hvd.rank()
        results["rank_before_init_is_a_clear_error"] = "rank() before init() did not raise"
    except ValueError as exc:
        results["rank_before_init_is_a_clear_error"] = "ok" if "hvd.init()" in str(exc) else str(exc)
    hvd.init()
    results.update(run_checks(CHECKS, hvd))
    hvd.shutdown()
    return results
