"""Checks of op=hvd.Adasum in horovod_spark.torch, run in every rank of one launch
(see test_adasum.py).  Every rank builds every rank's input (`vec(r, ...)`), so each
result is compared with `reference`: the same tree written here again, from the
definition, as a recursion over halves of the rank list.  Within a few units in the
last place of the vector's scale, and no more: the backend sums the dot products of
each half on the rank that holds it (vector halving), numpy in one pass, so the
coefficients may differ in their last bits; everything else is the same arithmetic.
"""
from __future__ import annotations

import numpy as np
import torch

from _torch_support import run_checks


def reference(vectors: list, dtype) -> np.ndarray:
    """Adasum of 1-d numpy vectors in rank order: the lower half's result combined
    with the upper half's, dots in float64, each result rounded to `dtype`."""
    if len(vectors) == 1:
        return vectors[0].astype(dtype)
    half = len(vectors) // 2
    a = reference(vectors[:half], dtype).astype(np.float64)
    b = reference(vectors[half:], dtype).astype(np.float64)
    dot, aa, bb = np.dot(a, b), np.dot(a, a), np.dot(b, b)
    ca = 1.0 - dot / (2.0 * aa) if aa > 0 else 1.0
    cb = 1.0 - dot / (2.0 * bb) if bb > 0 else 1.0
    return (ca * a + cb * b).astype(dtype)


def vec(r: int, n: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Rank r's tensor: random, with a shared component so that dots are not ~0."""
    g = np.random.default_rng([seed, r])
    shared = np.random.default_rng(seed).standard_normal(n)
    return torch.from_numpy(shared + g.standard_normal(n)).to(dtype)


def expected(size: int, n: int, seed: int, dtype) -> torch.Tensor:
    if dtype == torch.bfloat16:  # combined in float32, rounded once at the end
        rows = [vec(q, n, seed, dtype).float().numpy() for q in range(size)]
        return torch.from_numpy(reference(rows, np.float32)).to(torch.bfloat16)
    rows = [vec(q, n, seed, dtype).numpy() for q in range(size)]
    return torch.from_numpy(reference(rows, rows[0].dtype))


ULPS = 4  # the dot products' last bits, through the coefficients, in the rounded result


def same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape)
    eps = torch.finfo(want.dtype).eps
    g, w = got.double(), want.double()
    scale = float(w.abs().max()) if w.numel() else 0.0
    bad = (g - w).abs() > ULPS * eps * scale
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off by up to " \
                          f"{float((g - w).abs().max())} (scale {scale}, eps {eps})"


def allreduce_matches_the_reference_tree_in_every_float_dtype(hvd):
    r, n = hvd.rank(), hvd.size()
    for i, dtype in enumerate((torch.float16, torch.bfloat16, torch.float32, torch.float64)):
        for count in (1, 7, 1000):
            got = hvd.allreduce(vec(r, count, 10 * i + count, dtype), op=hvd.Adasum)
            same(got, expected(n, count, 10 * i + count, dtype), f"{dtype} x {count}")
    y = vec(r, 12, 3).reshape(3, 4)
    hvd.allreduce_(y, op=hvd.Adasum, name="adasum.inplace")
    same(y, expected(n, 12, 3, torch.float32).reshape(3, 4), "in place")


def its_definition_holds_for_parallel_orthogonal_and_zero_vectors(hvd):
    r, n = hvd.rank(), hvd.size()
    parallel = torch.tensor([1.0, 2.0, -3.0], dtype=torch.float64)
    assert torch.allclose(hvd.allreduce(parallel, op=hvd.Adasum), parallel), "parallel: average"
    axis = torch.zeros(n, dtype=torch.float64)
    axis[r] = 1.0 + r
    want = torch.arange(1, n + 1, dtype=torch.float64)
    assert torch.equal(hvd.allreduce(axis, op=hvd.Adasum), want), "orthogonal: sum"
    only_rank0 = torch.full((4,), 2.5) if r == 0 else torch.zeros(4)
    assert torch.equal(hvd.allreduce(only_rank0, op=hvd.Adasum), torch.full((4,), 2.5)), "zeros"


def grouped_tensors_combine_each_with_its_own_dot_products(hvd):
    r, n = hvd.rank(), hvd.size()
    sizes = (5, 300, 1)
    ts = [vec(r, k, 40 + k) * (1 + 10 * j) for j, k in enumerate(sizes)]
    got = hvd.grouped_allreduce(ts, op=hvd.Adasum)
    every = [[vec(q, k, 40 + k) * (1 + 10 * j) for j, k in enumerate(sizes)] for q in range(n)]
    for j, g in enumerate(got):
        want = reference([every[q][j].numpy() for q in range(n)], np.float32)
        same(g, torch.from_numpy(want), f"tensor {j}")
    fused = reference([torch.cat(every[q]).numpy() for q in range(n)], np.float32)
    assert n == 1 or not np.array_equal(torch.cat(got).numpy(), fused), "combined as one buffer"
    inplace = [t.clone() for t in ts]
    hvd.grouped_allreduce_(inplace, op=hvd.Adasum)
    for g, t in zip(got, inplace):
        same(t, g, "grouped in place")


def adasum_refuses_what_it_cannot_combine(hvd):
    for bad in (lambda: hvd.allreduce(torch.ones(3, dtype=torch.int32), op=hvd.Adasum),
                lambda: hvd.reducescatter(torch.ones(4), op=hvd.Adasum)):
        try:
            bad()
        except hvd.InvalidArgument as exc:
            assert "Adasum" in str(exc), exc
        else:
            raise AssertionError("not refused")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def _local_step(model, opt, q: int, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * q + step)
    x, y = torch.randn(8, 5, generator=g), torch.randn(8, 1, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def distributed_optimizer_combines_the_optimizers_deltas(hvd):
    r, n = hvd.rank(), hvd.size()
    make = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    model = _model()
    opt = hvd.DistributedOptimizer(make(model), named_parameters=model.named_parameters(),
                                   op=hvd.Adasum)
    assert isinstance(opt, torch.optim.SGD)
    replicas = [_model() for _ in range(n)]  # every rank's model and optimizer, here
    local_opts = [make(m) for m in replicas]
    for step in range(3):
        _local_step(model, opt, r, step)
        start = [p.detach().clone() for p in replicas[0].parameters()]
        deltas = []
        for q in range(n):
            with torch.no_grad():
                for p, s in zip(replicas[q].parameters(), start):
                    p.copy_(s)
            _local_step(replicas[q], local_opts[q], q, step)
            deltas.append([(p.detach() - s).numpy() for p, s in zip(replicas[q].parameters(), start)])
        for j, (p, s) in enumerate(zip(model.parameters(), start)):
            want = s + torch.from_numpy(reference([d[j].reshape(-1) for d in deltas], np.float32)
                                        .reshape(s.shape))
            same(p.detach(), want, f"step {step} parameter {j}")
        with torch.no_grad():
            for m in replicas:
                for p, w in zip(m.parameters(), model.parameters()):
                    p.copy_(w)


CHECKS = [allreduce_matches_the_reference_tree_in_every_float_dtype,
          its_definition_holds_for_parallel_orthogonal_and_zero_vectors,
          grouped_tensors_combine_each_with_its_own_dot_products,
          adasum_refuses_what_it_cannot_combine,
          distributed_optimizer_combines_the_optimizers_deltas]


def run_all() -> dict:
    torch.set_num_threads(1)
    import horovod_spark.torch as hvd
    hvd.init()
    results = {}
    if hvd.size() & (hvd.size() - 1):  # not a power of two: every Adasum op is refused
        results["refused"] = _refused_off_powers_of_two(hvd)
    else:
        results.update(run_checks(CHECKS, hvd))
    hvd.shutdown()
    return results


def _refused_off_powers_of_two(hvd) -> str:
    from collectives import NotSupported

    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum)
    for bad in (lambda: hvd.allreduce(torch.ones(3), op=hvd.Adasum),
                lambda: hvd.grouped_allreduce([torch.ones(3)], op=hvd.Adasum),
                lambda: _local_step(model, opt, hvd.rank(), 0)):
        try:
            bad()
        except NotSupported as exc:
            if "power-of-two" not in str(exc) or f"has {hvd.size()}" not in str(exc):
                return f"unclear refusal: {exc}"
        else:
            return "not refused"
    return "ok"
