"""Checks of process sets, run in every rank of one launch (see test_process_sets.py).

Every launch registers the same four sets, in this order: the even ranks, the odd
ranks, the first two and the last two (`SETS`); the launch's mode says how
(hvd.init(process_sets=[...]), or add_process_set with dynamic sets on).  Every rank
builds every rank's input, so each result is checked against numpy.
"""
from __future__ import annotations

import os
import threading
import time
import traceback

import numpy as np
import torch

from _torch_support import run_checks


def set_ranks(n: int) -> list:
    return [[r for r in range(n) if r % 2 == 0], [r for r in range(n) if r % 2 == 1],
            [0, 1], [n - 2, n - 1]]


def data(r: int, shape, dtype=torch.float32, tag: int = 0) -> torch.Tensor:
    """Rank r's tensor: distinct per rank and tag, exact in every float dtype."""
    n = int(np.prod(shape))
    return torch.from_numpy(((np.arange(n) % 7) + 10 * r + tag).reshape(shape)).to(dtype)


def set_ops_match_numpy(hvd, sets):
    r = hvd.rank()
    for ps in sets:
        if r not in ps.ranks:
            continue
        _one_set_ops(hvd, ps)


def _one_set_ops(hvd, ps):
    r, members, m = hvd.rank(), ps.ranks, len(ps.ranks)
    me = members.index(r)
    assert (ps.size(), ps.rank(), ps.included()) == (m, me, True), ps
    total = sum(data(k, (5,)) for k in members)
    assert torch.equal(hvd.allreduce(data(r, (5,)), op=hvd.Sum, process_set=ps), total)
    assert torch.allclose(hvd.allreduce(data(r, (5,)), process_set=ps), total / m)
    x = data(r, (5,), torch.int32, 1)
    hvd.allreduce_(x, op=hvd.Average, process_set=ps)  # integers truncate toward zero
    want = sum(data(k, (5,), torch.int64, 1) for k in members)
    assert x.tolist() == torch.div(want, m, rounding_mode="trunc").tolist(), x
    got = hvd.grouped_allreduce([data(r, (3,)), data(r, (2, 2), torch.float64)], op=hvd.Sum,
                                process_set=ps)
    assert torch.equal(got[1], sum(data(k, (2, 2), torch.float64) for k in members))
    gathered = hvd.allgather(torch.full((me + 1, 2), float(r)), process_set=ps)
    assert gathered[:, 0].tolist() == [float(k) for i, k in enumerate(members) for _ in range(i + 1)]
    for root in members:  # roots are world ranks, as in Horovod
        assert hvd.broadcast(data(r, (4,)), root, process_set=ps).tolist() == data(root, (4,)).tolist()
    splits = [i + 1 for i in range(m)]
    out, recv = hvd.alltoall(torch.full((sum(splits),), float(r)), splits=splits, process_set=ps)
    assert recv.tolist() == [me + 1] * m and out.tolist() == [float(k) for k in members for _ in range(me + 1)]
    rows = 2 * m + 1
    scattered = hvd.reducescatter(data(r, (rows, 2)), op=hvd.Sum, process_set=ps)
    start = sum(rows // m + (1 if i < rows % m else 0) for i in range(me))
    assert torch.equal(scattered, sum(data(k, (rows, 2)) for k in members)[start:start + len(scattered)])
    ga, = hvd.grouped_allgather([torch.tensor([float(r)])], process_set=ps)
    assert ga.tolist() == [float(k) for k in members]
    assert hvd.broadcast_object({"from": r}, members[-1], process_set=ps) == {"from": members[-1]}
    assert hvd.allgather_object(r * 3, process_set=ps) == [k * 3 for k in members]
    hvd.barrier(process_set=ps)
    if m in (1, 2, 4):  # Adasum's tree over the members' rows only
        from collectives.adasum import tree

        rows = np.stack([data(k, (6,)).numpy() / 10 + k for k in members])
        got = hvd.allreduce(torch.from_numpy(rows[me]), op=hvd.Adasum, process_set=ps)
        assert np.allclose(got.numpy(), tree(rows), rtol=1e-6), (got, tree(rows))
    a = torch.ones(2, requires_grad=True)
    hvd.allgather(a * (r + 1), process_set=ps).sum().backward()
    assert a.grad.tolist() == [float(r + 1)] * 2, a.grad  # the averaged gradient's own rows


def a_rank_outside_a_set_is_refused_naming_it(hvd, sets):
    r = hvd.rank()
    for ps in sets:
        if r in ps.ranks:
            continue
        assert ps.included() is False
        for call in (lambda: hvd.allreduce(torch.ones(2), process_set=ps),
                     lambda: hvd.allgather_async(torch.ones(2), process_set=ps),
                     lambda: hvd.barrier(process_set=ps)):
            try:
                call()
            except hvd.InvalidArgument as exc:  # a ValueError and a RuntimeError, as Horovod's
                assert isinstance(exc, RuntimeError)
                assert f"world rank {r} is not a member" in str(exc), exc
                assert str(ps.ranks) in str(exc), exc
            else:
                raise AssertionError(f"an op on {ps} ran on rank {r}")
        try:
            ps.rank()
        except ValueError as exc:
            assert "not in process set" in str(exc)
        else:
            raise AssertionError("rank() of a foreign set did not refuse")


def sets_run_concurrently_without_deadlock(hvd, sets):
    """One thread per set this rank is in, and the main thread on the global set, all at
    once: each set negotiates on its own, so none waits for another."""
    r, n = hvd.rank(), hvd.size()
    results, errors = {}, []

    def work(ps, key):
        try:
            for i in range(20):
                out = hvd.allreduce(torch.full((3,), float(r + i)), op=hvd.Sum,
                                    name=f"concurrent.{key}.{i}", process_set=ps)
                want = float(sum(k + i for k in ps.ranks))
                assert out.tolist() == [want] * 3, (key, i, out)
            results[key] = True
        except BaseException:
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=work, args=(ps, k)) for k, ps in enumerate(sets)
               if r in ps.ranks]
    for t in threads:
        t.start()
    for i in range(10):
        assert hvd.allreduce(torch.ones(2), op=hvd.Sum, name=f"concurrent.world.{i}").tolist() == [n, n]
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a set's ops did not finish within 60 s"
    assert not errors, errors[0]
    # async ops on two sets, waited for in the opposite order on the rank in both
    a, b = sets[2], sets[3]
    hs = {k: hvd.allreduce_async(torch.tensor([float(r)]), op=hvd.Sum, name=f"order.{k}",
                                 process_set=ps) for k, ps in (("b", b), ("a", a)) if r in ps.ranks}
    for k in sorted(hs):
        ps = a if k == "a" else b
        assert hvd.synchronize(hs[k]).tolist() == [float(sum(ps.ranks))]


def a_mismatch_inside_a_set_names_the_set(hvd, sets):
    r, ps = hvd.rank(), sets[3]
    if r in ps.ranks:
        try:
            hvd.allreduce(torch.ones(2 + ps.ranks.index(r)), name="mismatched", process_set=ps)
        except RuntimeError as exc:
            text = str(exc)
            assert f"process set {ps.process_set_id} of world ranks {ps.ranks}" in text, text
            assert "mismatched" in text, text
        else:
            raise AssertionError("a mismatch inside a set went unnoticed")
        assert hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=ps).tolist() == [2.0, 2.0]
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).tolist() == [float(hvd.size())]


def _resources() -> tuple:
    """Open fds, threads (the kernel's count) and mapped shared-memory segments."""
    with open("/proc/self/maps") as f:
        segments = sum("/dev/shm/hvs-" in line for line in f)
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task")), segments


def _settled(within: float = 0.5) -> tuple:
    """_resources() once it has not changed for a moment: a joined thread leaves the
    kernel's task list a little after Python sees it end."""
    last, stable = _resources(), time.monotonic()
    while time.monotonic() - stable < within:
        time.sleep(0.05)
        now = _resources()
        if now != last:
            last, stable = now, time.monotonic()
    return last


def _no_more_than(before: tuple, within: float = 10.0) -> tuple:
    """_resources() once none of them exceeds `before` (a leak never gets there)."""
    deadline = time.monotonic() + within
    now = _resources()
    while time.monotonic() < deadline and any(a > b for a, b in zip(now, before)):
        time.sleep(0.05)
        now = _resources()
    return now


def dynamic_sets_add_remove_and_free_what_they_held(hvd, sets):
    if not hvd.STATE._psets.dynamic:
        for call in (lambda: hvd.add_process_set([0]), lambda: hvd.remove_process_set(sets[0])):
            try:
                call()
            except ValueError as exc:
                assert "HOROVOD_DYNAMIC_PROCESS_SETS=1" in str(exc), exc
            else:
                raise AssertionError("a static job added or removed a set")
        return
    r, n = hvd.rank(), hvd.size()
    assert hvd.remove_process_set(sets[2]) is True  # [0, 1]: what it held is gone after
    before = _settled()
    ps = hvd.add_process_set(hvd.ProcessSet([1, 0]))
    assert ps.ranks == [0, 1] and ps.process_set_id == 3, ps  # the smallest free id
    if r in (0, 1):
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=ps).tolist() == [2.0]
        assert _resources() != before or n == 2  # it held something while registered
    assert hvd.remove_process_set(ps) is True and ps.process_set_id is None
    after = _no_more_than(before)
    assert all(a <= b for a, b in zip(after, before)), \
        f"fds, threads, segments before the set: {before}, after its removal: {after}"
    assert hvd.remove_process_set(ps) is False
    assert hvd.remove_process_set(hvd.global_process_set) is False
    try:
        hvd.allreduce(torch.ones(1), process_set=ps)
    except ValueError as exc:
        assert "not registered" in str(exc), exc
    else:
        raise AssertionError("an op on a removed set ran")
    for bad in ([r], list(range(n)), sets[0].ranks):  # disagreeing, the global set, a duplicate
        try:
            hvd.add_process_set(bad)
        except ValueError as exc:
            text = str(exc)
            assert ("rank 0: [0]" in text and f"rank {n - 1}: [{n - 1}]" in text) or \
                "global process set" in text or "already registered" in text, text
        else:
            raise AssertionError(f"add_process_set({bad}) was accepted")
    assert [p.process_set_id for p in hvd.STATE.process_sets()] == [0, 1, 2, 4]


def distributed_optimizer_on_a_set_matches_one_process(hvd, sets):
    """The first two ranks train one model together; on the others the same optimizer
    steps alone, as Horovod's does."""
    ps, r = sets[2], hvd.rank()
    if r not in ps.ranks:
        model = torch.nn.Linear(2, 1, bias=False)
        torch.nn.init.ones_(model.weight)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                       named_parameters=model.named_parameters(), process_set=ps)
        model(torch.tensor([[float(r), 1.0]])).sum().backward()
        opt.step()
        assert model.weight.tolist() == [[1.0 - r, 0.0]], model.weight  # its own gradient
        return
    torch.manual_seed(r)  # different initial weights: the broadcast must fix them
    model = torch.nn.Linear(4, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=1, process_set=ps)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
                                   named_parameters=model.named_parameters(), process_set=ps)
    hvd.broadcast_optimizer_state(opt, root_rank=1, process_set=ps)
    torch.manual_seed(1)
    ref = torch.nn.Linear(4, 1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5)
    for step in range(4):
        xs = [data(k, (3, 4), tag=step) / 50 for k in ps.ranks]
        ys = [x.sum(1, keepdim=True) for x in xs]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xs[ps.rank()]), ys[ps.rank()]).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p, q, atol=1e-6), (p, q)


def sets_are_numbered_alike_and_init_takes_duplicates_as_horovod(hvd, sets):
    n = hvd.size()
    assert [ps.process_set_id for ps in sets] == [1, 2, 3, 4], sets
    ids = hvd.allgather(torch.tensor([ps.process_set_id for ps in sets]))
    assert ids.tolist() == [1, 2, 3, 4] * n, ids  # the same ids on every rank
    assert str(hvd.global_process_set) == \
        f"ProcessSet(process_set_id=0, ranks={list(range(n))}, mpi_comm=None)"
    for extra, want in getattr(hvd, "_extras", []):  # init(): a duplicate is that set
        assert extra.process_set_id == want and extra.ranks == sorted(extra.ranks), extra
        if extra.process_set_id and hvd.rank() in extra.ranks:
            assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=extra).tolist() == \
                [float(len(extra.ranks))]


CHECKS = [sets_are_numbered_alike_and_init_takes_duplicates_as_horovod, set_ops_match_numpy, a_rank_outside_a_set_is_refused_naming_it,
          sets_run_concurrently_without_deadlock, a_mismatch_inside_a_set_names_the_set,
          distributed_optimizer_on_a_set_matches_one_process,
          dynamic_sets_add_remove_and_free_what_they_held]  # last: it removes a set


def run_all(mode: str) -> dict:
    """mode: 'static' (hvd.init(process_sets=[...])), 'dynamic' (hvd.init(process_sets=
    'dynamic')) or 'env' (HOROVOD_DYNAMIC_PROCESS_SETS=1 in the launch's environment)."""
    torch.set_num_threads(1)
    import horovod_spark.torch as hvd
    from horovod_spark.torch import _state

    hvd.STATE = _state.STATE
    n = int(os.environ["HVS_SIZE"])
    if mode == "static":  # plus the global set and a permuted duplicate, which init() takes
        sets = [hvd.ProcessSet(ranks) for ranks in set_ranks(n)]
        extras = [hvd.ProcessSet(list(range(n))[::-1]), hvd.ProcessSet(set_ranks(n)[0][::-1])]
        hvd.init(process_sets=sets + extras)
        hvd._extras = list(zip(extras, [0, 1]))
    else:
        hvd.init(process_sets="dynamic" if mode == "dynamic" else None)
        sets = [hvd.add_process_set(ranks) for ranks in set_ranks(n)]
    results = run_checks(CHECKS, hvd, sets)
    hvd.shutdown()
    return results
