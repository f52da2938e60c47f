"""Checks that horovod_spark.torch computes what Horovod's torch API computes, run in
every rank of one launch (see test_torch_parity.py): integer Average and scale
factors, reducescatter's refusals and gradients, the errors a script catches.

Every rank builds every rank's input (`ints(r)`), so each result is checked
against numpy.
"""
from __future__ import annotations

import numpy as np
import torch

from _torch_support import run_checks


def ints(r: int, dtype=torch.int32, n: int = 6) -> torch.Tensor:
    """Rank r's integers: both signs (unsigned dtypes: small positives)."""
    base = np.arange(n) * 3 - 7 + 5 * r
    if not dtype.is_signed:
        base = np.abs(base) % 50
    return torch.from_numpy(base).to(dtype)


def trunc_scaled(a: np.ndarray, factor: float) -> np.ndarray:
    """Horovod's integer scaling: the float64 product truncated toward zero."""
    return np.trunc(a.astype(np.float64) * factor)


def reduced(size: int, dtype, pre: float = 1.0, post: float = 1.0, average: bool = False):
    xs = [trunc_scaled(ints(r, dtype).numpy(), pre) for r in range(size)]
    return trunc_scaled(np.sum(xs, 0), post / (size if average else 1))


def my_rows(total: int, rank: int, size: int) -> slice:
    base, rem = divmod(total, size)
    start = rank * base + min(rank, rem)
    return slice(start, start + base + (1 if rank < rem else 0))


def integer_average_truncates_toward_zero(hvd):
    r, n = hvd.rank(), hvd.size()
    for dtype in (torch.int32, torch.int64, torch.int8, torch.uint8):
        got = hvd.allreduce(ints(r, dtype), op=hvd.Average)
        want = reduced(n, dtype, average=True)
        assert got.dtype == dtype and got.tolist() == want.tolist(), (dtype, got, want)
        y = ints(r, dtype)
        hvd.allreduce_(y)  # Average is the default
        assert y.tolist() == want.tolist(), (dtype, y, want)


def integer_scale_factors_scale_as_horovod(hvd):
    r, n = hvd.rank(), hvd.size()
    for dtype in (torch.int32, torch.int64, torch.uint8):
        for op, avg in ((hvd.Sum, False), (hvd.Average, True)):
            got = hvd.allreduce(ints(r, dtype), op=op, prescale_factor=2.5, postscale_factor=0.5)
            want = reduced(n, dtype, 2.5, 0.5, avg)
            assert got.dtype == dtype and got.tolist() == want.tolist(), (dtype, op, got, want)
        x = ints(r, dtype, n=2 * n + 1)
        rows = my_rows(2 * n + 1, r, n)
        full = np.sum([trunc_scaled(ints(q, dtype, 2 * n + 1).numpy(), 3.0) for q in range(n)], 0)
        got = hvd.reducescatter(x, op=hvd.Sum, prescale_factor=3.0)
        assert got.tolist() == full[rows].tolist(), (dtype, got, full[rows])
        got = hvd.reducescatter(x, op=hvd.Average, postscale_factor=2.0)
        plain = np.sum([ints(q, dtype, 2 * n + 1).numpy() for q in range(n)], 0)
        assert got.tolist() == np.trunc(plain * (2.0 / n))[rows].tolist(), (dtype, got)
        g1, g2 = hvd.grouped_reducescatter([x, x * 2], op=hvd.Average)
        assert g1.tolist() == np.trunc(plain / n)[rows].tolist(), (dtype, g1)
        assert g2.tolist() == np.trunc(plain * 2 / n)[rows].tolist(), (dtype, g2)


def reducescatter_refuses_a_scalar(hvd):
    for call in (lambda: hvd.reducescatter(torch.tensor(1.0)),
                 lambda: hvd.grouped_reducescatter([torch.ones(4), torch.tensor(2.0)])):
        try:
            call()
        except RuntimeError as exc:  # what Horovod scripts catch
            assert isinstance(exc, ValueError) and isinstance(exc, hvd.InvalidArgument), exc
            assert "0-d" in str(exc), exc
        else:
            raise AssertionError("a 0-d reducescatter did not raise")
    hvd.barrier()  # nothing was left pending: the next ops match
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == hvd.size()


def reducescatter_gradients_are_horovods(hvd):
    r, n = hvd.rank(), hvd.size()
    for op, scale in ((hvd.Sum, n), (hvd.Average, 1)):
        x = torch.ones(2 * n, 3, requires_grad=True)
        (hvd.reducescatter(x, op=op) * (r + 1)).sum().backward()
        want = np.repeat([[q + 1.0] * 3 for q in range(n)], 2, axis=0) * scale
        np.testing.assert_array_equal(x.grad.numpy(), want)
        x = torch.ones(2 * n, requires_grad=True)
        hvd.reducescatter(x, op=op, prescale_factor=2.0, postscale_factor=3.0).sum().backward()
        np.testing.assert_array_equal(x.grad.numpy(), np.full(2 * n, 6.0 * scale))
        a, b = (torch.ones(n, requires_grad=True), torch.ones(2 * n, 2, requires_grad=True))
        ga, gb = hvd.grouped_reducescatter([a, b], op=op)
        (ga.sum() + 2 * gb.sum()).backward()
        assert a.grad.tolist() == [1.0 * scale] * n, (op, a.grad)
        assert (b.grad == 2.0 * scale).all(), (op, b.grad)


def errors_are_the_types_horovod_scripts_catch(hvd):
    r, n = hvd.rank(), hvd.size()
    cases = [("shape", lambda: hvd.allreduce(torch.ones(2 + r), name="parity.shape")),
             ("dtype", lambda: hvd.allreduce(torch.ones(2, dtype=torch.float32 if r else
                                                        torch.float64), name="parity.dtype")),
             ("splits", lambda: hvd.alltoall(torch.ones(n + 1), splits=[1] * n)),
             ("root", lambda: hvd.broadcast(torch.ones(2), root_rank=n + 3))]
    for what, call in cases:
        try:
            call()
        except RuntimeError as exc:
            assert str(exc), what
        else:
            raise AssertionError(f"a mismatched {what} did not raise")


def sync_batch_norm_matches_batch_norm_over_every_ranks_batch(hvd):
    r, n = hvd.rank(), hvd.size()

    def batch(q):  # ranks hold different batch sizes
        g = torch.Generator().manual_seed(50 + q)
        return torch.randn(q + 2, 3, 4, generator=g, dtype=torch.float64) * (q + 1) + q

    def coeff(q):
        return torch.arange((q + 2) * 12, dtype=torch.float64).view(q + 2, 3, 4) % 5 - q

    sync = hvd.SyncBatchNorm(3, momentum=0.3).double()
    ref = torch.nn.BatchNorm1d(3, momentum=0.3).double()
    with torch.no_grad():
        for m in (sync, ref):
            m.weight.copy_(torch.tensor([1.0, 2.0, -0.5]))
            m.bias.copy_(torch.tensor([0.1, 0.0, 0.3]))
    x = batch(r).requires_grad_()
    y = sync(x)
    (y * coeff(r)).sum().backward()
    full = torch.cat([batch(q) for q in range(n)]).requires_grad_()
    y_ref = ref(full)
    (y_ref * torch.cat([coeff(q) for q in range(n)])).sum().backward()
    start = sum(q + 2 for q in range(r))
    mine = slice(start, start + r + 2)
    np.testing.assert_allclose(y.detach().numpy(), y_ref[mine].detach().numpy(), rtol=1e-9,
                               atol=1e-9)
    np.testing.assert_allclose(x.grad.numpy(), full.grad[mine].numpy(), rtol=1e-9, atol=1e-9)
    for a, b in ((sync.running_mean, ref.running_mean), (sync.running_var, ref.running_var)):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-9)
    for p, q in ((sync.weight, ref.weight), (sync.bias, ref.bias)):  # local grads add up
        np.testing.assert_allclose(hvd.allreduce(p.grad, op=hvd.Sum).numpy(), q.grad.numpy(),
                                   rtol=1e-9, atol=1e-9)
    sync.eval()
    with torch.no_grad():
        got = sync(batch(r))
    ref.eval()
    np.testing.assert_allclose(got.numpy(), ref(batch(r)).detach().numpy(), rtol=1e-9)


def sparse_gradients_train_an_embedding_with_sparse_adam(hvd):
    r, n = hvd.rank(), hvd.size()
    idx = lambda q: torch.tensor([q % 5, 7, (3 * q + 1) % 10])  # noqa: E731  rank q's rows
    sp = torch.sparse_coo_tensor(idx(r).unsqueeze(0), torch.full((3, 2), r + 1.0), (10, 2))
    got = hvd.synchronize(hvd.sparse_allreduce_async(sp, name="parity.sparse", op=hvd.Sum))
    want = sum(torch.sparse_coo_tensor(idx(q).unsqueeze(0), torch.full((3, 2), q + 1.0),
                                       (10, 2)).to_dense() for q in range(n))
    assert got.is_sparse and torch.equal(got.to_dense(), want), (got, want)
    for sparse_as_dense in (False, True):  # as Horovod: SparseAdam gets a sparse gradient
        torch.manual_seed(0)           # back from a dense reduction too
        emb, ref = torch.nn.Embedding(10, 2, sparse=True), torch.nn.Embedding(10, 2, sparse=True)
        ref.load_state_dict(emb.state_dict())
        opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(emb.parameters(), lr=0.1),
                                       named_parameters=emb.named_parameters(),
                                       sparse_as_dense=sparse_as_dense)
        ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.1)
        for step in range(2):
            opt.zero_grad()
            (emb(idx(r)) * (r + 1)).sum().backward()
            opt.step()
            assert emb.weight.grad.is_sparse, emb.weight.grad.layout
            ref_opt.zero_grad()  # the same step on the mean of every rank's loss
            sum((ref(idx(q)) * (q + 1)).sum() for q in range(n)).div(n).backward()
            ref_opt.step()
        np.testing.assert_allclose(emb.weight.detach().numpy(), ref.weight.detach().numpy(),
                                   rtol=1e-6, atol=1e-7)


def half_scale_factors_scale_in_float32_as_horovod(hvd):
    """Horovod's CPU float16/bfloat16 scaling: each factor applied in float32 math and the
    product rounded to the dtype (test_horovod_allreduce_prescale / _postscale)."""
    n = hvd.size()
    factor = 0.1915194503788923  # Horovod's test: np.random.seed(1234); np.random.uniform()
    for dtype in (torch.float16, torch.bfloat16):
        for dim in (1, 2, 3):
            torch.manual_seed(1234)
            x = torch.FloatTensor(*([17] * dim)).random_(-100, 100).to(dtype)  # every rank's

            def summed(t):  # n equal values added in the dtype, one rounding an add
                acc = t
                for _ in range(n - 1):
                    acc = (acc.float() + t.float()).to(dtype)
                return acc
            f32 = float(np.float32(factor))
            pre = hvd.allreduce(x, op=hvd.Sum, prescale_factor=factor)
            want = summed((x.float() * f32).to(dtype))
            assert torch.equal(pre, want), (dtype, dim, (pre.float() - want.float()).abs().max())
            post = hvd.allreduce(x, op=hvd.Sum, postscale_factor=factor)
            want = (summed(x).float() * f32).to(dtype)
            assert torch.equal(post, want), (dtype, dim, (post.float() - want.float()).abs().max())
            y = x.clone()
            hvd.allreduce_(y, op=hvd.Average, postscale_factor=factor)  # 1/size folded in
            want = (summed(x).float() * float(np.float32(factor / n))).to(dtype)
            assert torch.equal(y, want), (dtype, dim, "average")


def a_sparse_handle_is_called_for_its_result(hvd):
    """test_async_sparse_allreduce: Horovod's sparse_allreduce_async returns a function."""
    torch.manual_seed(7)
    tensors = [torch.rand(d, 10) for d in (17, 32, 5)]
    for t in tensors:
        t[t < 0.8] = 0
    handles = [hvd.sparse_allreduce_async(t.to_sparse(), op=hvd.Average, name=f"call.{i}")
               for i, t in enumerate(tensors)]
    for t, handle in zip(tensors, handles):
        got = handle()
        assert got.is_sparse and torch.allclose(got.to_dense(), t, rtol=1e-6), got  # every rank's t


def a_new_optimizers_state_is_made_as_horovod_makes_it(hvd):
    """test_broadcast_state_no_grad: zero gradients for the parameters that take one, one
    step of the wrapped optimizer, and no gradient for one that takes none."""
    class NoGrad(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Parameter(torch.tensor([1, 3], dtype=torch.int32),
                                        requires_grad=False)
            self.b = torch.nn.Parameter(torch.arange(4.0) + hvd.rank())

    model = NoGrad()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.001, weight_decay=1e-6, momentum=0.9,
                        nesterov=True), named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    grad = opt.param_groups[0]["params"][1].grad
    assert opt.param_groups[0]["params"][0].grad is None
    assert grad is not None and torch.equal(hvd.broadcast(grad, root_rank=0), grad)
    assert torch.equal(grad, torch.zeros(4))
    momentum = opt.state[model.b]["momentum_buffer"]  # made by the one step, then broadcast
    assert torch.allclose(momentum, torch.arange(4.0) * 1e-6, rtol=1e-6, atol=0), momentum


def optimizer_state_with_non_tensor_entries_broadcasts(hvd):
    r = hvd.rank()
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1 * (r + 1), momentum=0.9)
    opt.state[w].update(momentum_buffer=torch.full((2,), float(r)), scale=0.5 + r,
                        step=r + 5, extra=None, seen=(r, r + 1))
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    st = opt.state[w]
    assert (st["scale"], st["step"], st["extra"], st["seen"]) == (0.5, 5, None, (0, 1)), st
    assert st["momentum_buffer"].tolist() == [0.0, 0.0] and opt.param_groups[0]["lr"] == 0.1


def join_with_allreduces_pending_elsewhere_contributes_zeros(hvd):
    r, n = hvd.rank(), hvd.size()
    for first in range(n):  # rank `first` joins while the others reduce
        if r == first:
            last = hvd.join()
        else:
            total = sum(q + 1.0 for q in range(n) if q != first)
            got = hvd.allreduce(torch.full((3,), r + 1.0), op=hvd.Sum, name=f"join.sum.{first}")
            assert got.tolist() == [total] * 3, (first, got)
            avg = hvd.allreduce(torch.full((2,), r + 1.0), name=f"join.avg.{first}")
            np.testing.assert_allclose(avg.numpy(), [total / n] * 2, rtol=1e-6)  # / world size
            last = hvd.join()
        assert 0 <= last < n and last != first or n == 1, (first, last)


def allgather_and_broadcast_after_a_join_raise_on_the_running_ranks(hvd):
    r, n = hvd.rank(), hvd.size()
    for op in ("allgather", "broadcast"):
        if r == 0:
            last = hvd.join()
        else:
            try:
                if op == "allgather":
                    hvd.allgather(torch.ones(2), name="join.strict.ag")
                else:
                    hvd.broadcast(torch.ones(2), root_rank=n - 1, name="join.strict.bc")
            except RuntimeError as exc:  # what Horovod's tests catch
                assert "have joined" in str(exc) and "[0]" in str(exc), exc
            else:
                raise AssertionError(f"{op} after rank 0 joined did not raise")
            last = hvd.join()
        assert 0 < last < n, (op, last)


CHECKS = [integer_average_truncates_toward_zero, integer_scale_factors_scale_as_horovod,
          reducescatter_refuses_a_scalar, reducescatter_gradients_are_horovods,
          errors_are_the_types_horovod_scripts_catch,
          sync_batch_norm_matches_batch_norm_over_every_ranks_batch,
          sparse_gradients_train_an_embedding_with_sparse_adam,
          half_scale_factors_scale_in_float32_as_horovod,
          a_sparse_handle_is_called_for_its_result,
          a_new_optimizers_state_is_made_as_horovod_makes_it,
          optimizer_state_with_non_tensor_entries_broadcasts,
          join_with_allreduces_pending_elsewhere_contributes_zeros,
          allgather_and_broadcast_after_a_join_raise_on_the_running_ranks]


def run_all() -> dict:
    torch.set_num_threads(1)
    import horovod_spark.torch as hvd
    hvd.init()
    results = run_checks(CHECKS, hvd)
    hvd.shutdown()
    return results
