"""Checks of DistributedOptimizer, run inside every rank of one launch.

Every check trains a small CNN on synthetic batches and compares the result
with single-process training on the same global batch, computed in the same
rank without any communication.  The global batch of each step is split
evenly over the ranks, so the average of the ranks' mean losses is the
global mean loss.  `run_all(timeline)` returns {check name: "ok" or the
failure text}.
"""
from __future__ import annotations

import json
import traceback
import warnings

import torch
import torch.nn.functional as F

from _torch_support import run_checks

BATCH, STEPS, LR = 12, 4, 0.1


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(4 * 6 * 6, 3))


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 1, 8, 8, generator=g), torch.randint(0, 3, (BATCH,), generator=g)


def shard(t: torch.Tensor, r: int, n: int) -> torch.Tensor:
    per = t.shape[0] // n
    return t[r * per:(r + 1) * per]


def sgd(model) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def reference(steps: int = STEPS) -> torch.nn.Module:
    model = make_model()
    opt = sgd(model)
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def assert_close(model, ref, atol: float = 1e-5) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        err = (p.detach() - q.detach()).abs().max().item()
        assert err <= atol, f"{name}: max difference {err:.3g} > {atol:g}"


def distributed(hvd, **kw):
    model = make_model()
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(), **kw)
    return model, opt


def train(hvd, model, opt, steps: int = STEPS, passes: int = 1) -> None:
    r, n = hvd.rank(), hvd.size()
    for step in range(steps):
        x, y = batch(step)
        xs, ys = shard(x, r, n), shard(y, r, n)
        opt.zero_grad()
        for k in range(passes):
            F.cross_entropy(model(shard(xs, k, passes)), shard(ys, k, passes)).div(passes).backward()
        opt.step()


def training_matches_single_process_on_the_global_batch(hvd):
    model, opt = distributed(hvd)
    assert isinstance(opt, torch.optim.SGD)
    hvd.metrics(reset=True)
    train(hvd, model, opt)
    assert_close(model, reference())
    m = hvd.metrics()
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert m["bytes_reduced"] == STEPS * param_bytes, (m["bytes_reduced"], param_bytes)
    assert m["steps"] >= STEPS - 1 and m["step_time_s"] > 0 and m["sync_wait_s"] >= 0, m


def overlapped_and_grouped_defaults_train_alike(hvd):
    """num_groups=None groups CPU gradients when the ranks have no spare core, else overlaps."""
    from collectives.backends.native import usable_cores as _cores

    threads = torch.get_num_threads()
    try:
        for n in (1, _cores()):  # a spare core when local_size x 1 < cores; none with cores threads
            torch.set_num_threads(n)
            crowded = hvd.local_size() * n >= _cores()
            model, opt = distributed(hvd)
            assert opt._overlap != crowded, (n, _cores(), hvd.local_size())
            train(hvd, model, opt)
            assert_close(model, reference())
    finally:
        torch.set_num_threads(threads)
    model, opt = distributed(hvd, num_groups=0)  # overlap, asked for explicitly
    assert opt._overlap
    train(hvd, model, opt)
    assert_close(model, reference())


def backward_passes_per_step_accumulates_locally(hvd):
    model, opt = distributed(hvd, backward_passes_per_step=2)
    train(hvd, model, opt, passes=2)
    assert_close(model, reference())
    x, y = batch(0)
    for _ in range(2):
        F.cross_entropy(model(x), y).backward()
    try:
        F.cross_entropy(model(x), y).backward()
    except Exception as exc:  # the hook's error surfaces from backward()
        assert "backward_passes_per_step" in str(exc), str(exc)
    else:
        raise AssertionError("a third backward pass before step() did not raise")
    opt.synchronize()


def gradient_groups_train_like_the_reference(hvd):
    model, opt = distributed(hvd, num_groups=1)
    hvd.metrics(reset=True)
    train(hvd, model, opt)
    assert_close(model, reference())
    m = hvd.metrics()  # one bucket: one tensor, in place, per step, nothing to fuse
    assert m["tensors_reduced"] == STEPS and m["engine_fused_buffers"] == 0, m
    model = make_model()
    params = list(model.parameters())
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(),
                                   groups=[params[:2], params[2:]])
    train(hvd, model, opt)
    assert_close(model, reference())
    model, opt = distributed(hvd, num_groups=2, backward_passes_per_step=2)
    train(hvd, model, opt, passes=2)
    assert_close(model, reference())


def fp16_compression_trains_close_to_the_reference(hvd):
    model, opt = distributed(hvd, compression=hvd.Compression.fp16)
    train(hvd, model, opt)
    assert_close(model, reference(), atol=1e-2)
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


def gradient_predivide_factor_keeps_the_average(hvd):
    model, opt = distributed(hvd, gradient_predivide_factor=2.0)
    train(hvd, model, opt)
    assert_close(model, reference())


def synchronize_then_skip_synchronize_steps_once(hvd):
    model, opt = distributed(hvd)
    r, n = hvd.rank(), hvd.size()
    x, y = batch(0)
    opt.zero_grad()
    F.cross_entropy(model(shard(x, r, n)), shard(y, r, n)).backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e6)
    with opt.skip_synchronize():
        opt.step()
    assert_close(model, reference(1))
    opt.zero_grad()
    F.cross_entropy(model(shard(x, r, n)), shard(y, r, n)).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert any("skip_synchronize" in str(w.message) for w in caught), caught


def zero_grad_between_backward_and_step_is_refused(hvd):
    model, opt = distributed(hvd)
    x, y = batch(0)
    F.cross_entropy(model(x), y).backward()
    try:
        opt.zero_grad()
    except AssertionError as exc:
        assert "before optimizer.step()" in str(exc), str(exc)
    else:
        raise AssertionError("zero_grad() after backward() did not raise")
    opt.step()


def a_dropped_optimizer_stops_reducing_its_gradients(hvd):
    import gc
    model = make_model()
    first = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
    del first
    gc.collect()
    second = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
    train(hvd, model, second)  # the first one's hooks would submit every name twice
    assert_close(model, reference())


def gradients_are_views_of_their_bucket_and_zero_grad_keeps_them(hvd):
    model, opt = distributed(hvd)
    train(hvd, model, opt, steps=1)
    (bucket,) = opt._buckets
    for p in model.parameters():
        assert p.grad._base is bucket.flat, "a gradient is not a view of its bucket"
    opt.zero_grad()
    assert all(p.grad is not None and p.grad._base is bucket.flat and not p.grad.any()
               for p in model.parameters())
    model.zero_grad()  # set_to_none: autograd makes new gradients, copied into the views
    assert all(p.grad is None for p in model.parameters())
    r, n = hvd.rank(), hvd.size()
    x, y = batch(1)
    F.cross_entropy(model(shard(x, r, n)), shard(y, r, n)).backward()
    opt.step()
    assert all(p.grad._base is bucket.flat for p in model.parameters())
    assert_close(model, reference(2))


def mixed_dtypes_and_a_strided_parameter_train_like_one_process(hvd):
    """float64 and float32 parameters: a bucket each; a transposed (non-contiguous)
    parameter can't be a view, so it travels alone."""
    def build():
        torch.manual_seed(5)
        lin = torch.nn.Linear(4, 3).double()
        w32 = torch.nn.Parameter(torch.randn(3, 4))
        wt = torch.nn.Parameter(torch.randn(4, 3).t())  # stride (1, 3)
        return torch.nn.ParameterDict({"lin_w": lin.weight, "lin_b": lin.bias, "w32": w32,
                                       "wt": wt})

    def loss(ps, x):
        return ((x.double() @ ps["lin_w"].t() + ps["lin_b"]).sum()
                + (x @ ps["w32"].t()).pow(2).sum() + (x @ ps["wt"].t()).sum())

    r, n = hvd.rank(), hvd.size()
    x = torch.arange(24.0).reshape(6, 4) / 10
    ps = build()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(ps.parameters(), lr=0.01),
                                   named_parameters=ps.named_parameters())
    assert len(opt._buckets) == 2 and len(opt._loose) == 1 and opt._loose[0] is ps["wt"]
    ref = build()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    for step in range(3):
        if step == 1:
            hvd.metrics(reset=True)
        opt.zero_grad()
        loss(ps, shard(x, r, n)).backward()  # the average of the shards' sums
        opt.step()
        ref_opt.zero_grad()
        (loss(ref, x) / n).backward()
        ref_opt.step()
    for k in ps:
        assert torch.allclose(ps[k], ref[k], atol=1e-5), (k, ps[k], ref[k])
    # the buckets and the lone parameter keep their names from step to step: no new
    # signatures to negotiate after the first step
    assert hvd.metrics()["engine_negotiations"] == 0, hvd.metrics()


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.a, self.b = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)

    def forward(self, x, use_b: bool):
        return self.a(x) + (self.b(x) if use_b else 0)


def a_parameter_unused_on_some_ranks_is_reduced_as_zeros(hvd):
    r, n = hvd.rank(), hvd.size()
    model = TwoHeads()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters())
    before = model.b.weight.detach().clone()
    model(torch.ones(3, 4), use_b=(r == 0)).sum().backward()
    opt.step()
    grad_b0 = torch.ones(2, 4) * 3  # d/dW of sum(W x) over 3 rows of ones, on rank 0 only
    assert torch.allclose(model.b.weight.detach(), before - grad_b0 / n), model.b.weight
    weights = hvd.allgather_object([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for w in weights for a, b in zip(w, weights[0]))


def join_ends_uneven_batches_like_horovod(hvd):
    """Rank r has 2 + r batches; a joined rank contributes zeros; Average divides by size."""
    r, n = hvd.rank(), hvd.size()
    model, opt = distributed(hvd)
    for step in range(2 + r):
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(model(shard(x, r, n)), shard(y, r, n)).backward()
        opt.step()
    last = hvd.join()
    assert last == n - 1, last
    ref = make_model()
    ref_opt = sgd(ref)
    for step in range(2 + last):
        x, y = batch(step)
        ref_opt.zero_grad()
        for k in range(n):
            if 2 + k > step:  # ranks that still had a batch at this step
                F.cross_entropy(ref(shard(x, k, n)), shard(y, k, n)).div(n).backward()
        ref_opt.step()
    if r == last:
        assert_close(model, ref)
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)
    assert_close(model, ref)


CHECKS = [training_matches_single_process_on_the_global_batch,
          overlapped_and_grouped_defaults_train_alike,
          backward_passes_per_step_accumulates_locally,
          gradient_groups_train_like_the_reference,
          fp16_compression_trains_close_to_the_reference,
          gradient_predivide_factor_keeps_the_average,
          synchronize_then_skip_synchronize_steps_once,
          zero_grad_between_backward_and_step_is_refused,
          a_dropped_optimizer_stops_reducing_its_gradients,
          a_parameter_unused_on_some_ranks_is_reduced_as_zeros,
          gradients_are_views_of_their_bucket_and_zero_grad_keeps_them,
          mixed_dtypes_and_a_strided_parameter_train_like_one_process,
          join_ends_uneven_batches_like_horovod]


def timeline_check(path: str, rank: int) -> str:
    if rank != 0:
        return "ok"
    with open(path) as f:
        events = json.load(f)
    rows = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    phases = {e["name"] for e in events if e.get("ph") == "X"}
    missing = {"NEGOTIATE", "QUEUE", "ALLREDUCE"} - phases
    if "allreduce.0.weight..3.bias" not in rows or missing:  # the default optimizer's bucket
        return f"rows {sorted(rows)[:8]}..., missing phases {missing}"
    return "ok"


def run_all(timeline: str) -> dict:
    torch.set_num_threads(1)
    import horovod_spark.torch as hvd
    hvd.init()
    results = run_checks(CHECKS, hvd)
    rank = hvd.rank()
    hvd.shutdown()
    try:
        results["the_timeline_records_every_gradient"] = timeline_check(timeline, rank)
    except Exception:
        results["the_timeline_records_every_gradient"] = traceback.format_exc()
    return results
