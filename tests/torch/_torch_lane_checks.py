"""Checks of `horovod_spark.torch`'s blocking and async allreduces through the engine's lane
(horovod_spark/torch/_lane.py), run inside every rank of one launch.

`run_all(lane_off_on)` returns {check name: "ok" or the failure text, "lane_cycles": n}.
Every rank computes every rank's input, so each checks its results exactly: the inputs
are small integers, whose sums are exact in float16 too, and an Average's scale is
applied as numpy multiplies an array by a scalar of its own dtype (what the engine and
the lane both do).
"""
from __future__ import annotations

import os
import re

import numpy as np
import torch

from _torch_support import run_checks

DTYPES = (torch.float32, torch.float64, torch.float16)


def data(rank: int, step: int, shape, dtype) -> torch.Tensor:
    n = int(np.prod(shape))
    return torch.from_numpy((np.arange(n) % 13 + rank + step).astype(np.float64)).reshape(shape).to(dtype)


def want(size: int, step: int, shape, dtype, op, post: float, hvd, ranks=None) -> np.ndarray:
    npd = torch.empty(0, dtype=dtype).numpy().dtype
    total = sum(data(r, step, shape, dtype).numpy() for r in (ranks if ranks is not None else range(size)))
    scale = post / size if op == hvd.Average else post
    return total * npd.type(scale) if scale != 1.0 else total


def lane_on() -> bool:
    return os.environ.get("HOROVOD_SPARK_TORCH_LANE", "1") != "0"


def lane_cycles(hvd) -> int:
    return int(hvd.metrics()["engine_lane_cycles"])


def named_ops_run_in_the_lane_and_match_numpy(hvd):
    """Named allreduce_ and allreduce, Sum and Average, with and without a postscale, in
    three dtypes: every result exact, and after each name's first run the lane runs them."""
    r, n = hvd.rank(), hvd.size()
    before, ops = lane_cycles(hvd), 0
    for dtype in DTYPES:
        for op, post in ((hvd.Sum, 1.0), (hvd.Average, 1.0), (hvd.Sum, 0.5)):
            name, shape = f"metric.{dtype}.{int(op)}.{post}", (7, 11)
            for step in range(12):
                x = data(r, step, shape, dtype)
                if step % 2:
                    got = hvd.allreduce_(x, name=name, op=op, postscale_factor=post)
                    assert got is x
                else:
                    got = hvd.allreduce(x, name=name, op=op, postscale_factor=post)
                    assert got.data_ptr() != x.data_ptr()
                    np.testing.assert_array_equal(x.numpy(), data(r, step, shape, dtype).numpy())
                assert got.dtype == dtype and got.shape == shape, (got.dtype, got.shape)
                np.testing.assert_array_equal(got.numpy(), want(n, step, shape, dtype, op, post, hvd),
                                              err_msg=f"{name} step {step}")
                ops += 1
    ran = lane_cycles(hvd) - before
    # each name's first run arms its slot; the rest may all run in the lane
    assert (ops // 2 <= ran <= ops) if lane_on() else ran == 0, (ran, ops)


def one_name_with_new_shapes_and_dtypes_still_matches(hvd):
    r, n = hvd.rank(), hvd.size()
    for step, (shape, dtype) in enumerate((((4, 8), torch.float32), ((8, 4), torch.float32),
                                           ((32,), torch.float64), ((4, 8), torch.float32),
                                           ((8, 4), torch.float32))):
        for rep in range(3):
            got = hvd.allreduce(data(r, step + rep, shape, dtype), name="reshaped", op=hvd.Sum)
            assert got.shape == shape and got.dtype == dtype
            np.testing.assert_array_equal(got.numpy(), want(n, step + rep, shape, dtype, hvd.Sum, 1.0, hvd))


def horovods_metric_average_runs_in_the_lane(hvd):
    """Horovod's examples' metric_average: a 0-d tensor of a Python float, averaged by name
    every epoch."""
    r, n = hvd.rank(), hvd.size()
    before = lane_cycles(hvd)
    for epoch in range(10):
        for name in ("avg_loss", "avg_accuracy"):
            avg = hvd.allreduce(torch.tensor(float(r + epoch)), name=name)
            assert avg.shape == () and avg.dtype == torch.float32
            assert avg.item() == np.float32(sum(range(n)) + n * epoch) * np.float32(1.0 / n), avg
    ran = lane_cycles(hvd) - before
    assert ran >= 18 if lane_on() else ran == 0, ran


def ops_outside_the_lane_still_match_and_leave_it_alone(hvd):
    """Unnamed, non-contiguous, integer, bfloat16, prescaled, Min, a process set: the
    engine's path, each correct, and the lane runs none of them."""
    r, n = hvd.rank(), hvd.size()
    before = lane_cycles(hvd)
    for step in range(3):
        x = data(r, step, (6, 5), torch.float32)
        np.testing.assert_array_equal(hvd.allreduce(x, op=hvd.Sum).numpy(),
                                      want(n, step, (6, 5), torch.float32, hvd.Sum, 1.0, hvd))
        t = x.t()
        assert not t.is_contiguous()
        np.testing.assert_array_equal(hvd.allreduce(t, name="nc", op=hvd.Sum).numpy(),
                                      want(n, step, (6, 5), torch.float32, hvd.Sum, 1.0, hvd).T)
        i = data(r, step, (9,), torch.int32)
        np.testing.assert_array_equal(hvd.allreduce_(i, name="int", op=hvd.Sum).numpy(),
                                      want(n, step, (9,), torch.float64, hvd.Sum, 1.0, hvd).astype(np.int32))
        b = data(r, step, (9,), torch.bfloat16)
        np.testing.assert_array_equal(hvd.allreduce(b, name="bf16", op=hvd.Sum).double().numpy(),
                                      want(n, step, (9,), torch.float64, hvd.Sum, 1.0, hvd))
        np.testing.assert_array_equal(
            hvd.allreduce(x, name="pre", op=hvd.Sum, prescale_factor=2.0).numpy(),
            2 * want(n, step, (6, 5), torch.float32, hvd.Sum, 1.0, hvd))
        np.testing.assert_array_equal(hvd.allreduce(x, name="min", op=hvd.Min).numpy(),
                                      data(0, step, (6, 5), torch.float32).numpy())
    ps = hvd.global_process_set
    for step in range(3):  # the global set named explicitly is the global set: the lane's
        hvd.allreduce(data(r, step, (3,), torch.float32), name="explicit", op=hvd.Sum, process_set=ps)
    assert lane_cycles(hvd) - before <= 2, lane_cycles(hvd) - before


def gradients_flow_through_a_named_allreduce(hvd):
    n = hvd.size()
    for step in range(4):
        x = torch.full((5,), float(hvd.rank() + step), requires_grad=True)
        y = hvd.allreduce(x, name="with.grad", op=hvd.Sum)
        assert y.requires_grad
        assert y.tolist() == [float(sum(range(n)) + n * step)] * 5, y
        (y * 2).sum().backward()
        assert x.grad.tolist() == [2.0 * n] * 5, x.grad  # the gradient's allreduce, Sum


def pending_async_ops_and_the_lane_share_cycles(hvd):
    """Async ops in flight while a blocking named op runs: some ranks' vectors then hold
    other work, the lane hands such a cycle to the engine, and every result is exact."""
    r, n = hvd.rank(), hvd.size()
    for step in range(20):
        a = data(r, step, (1000,), torch.float32)
        h = hvd.allreduce_async_(a, name=f"async.{step % 4}", op=hvd.Sum)
        m = data(r, step, (17,), torch.float64)
        if (r + step) % 2:
            hvd.synchronize(h)
        hvd.allreduce_(m, name="metric.beside.async", op=hvd.Average)
        hvd.synchronize(h)
        np.testing.assert_array_equal(a.numpy(), want(n, step, (1000,), torch.float32, hvd.Sum, 1.0, hvd))
        np.testing.assert_array_equal(m.numpy(), want(n, step, (17,), torch.float64, hvd.Average, 1.0, hvd))


def threads_with_their_own_names_share_the_lane(hvd):
    """Two threads per rank, each with its own names, blocking ops at once: the ranks'
    threads reach the lane in different orders, a cycle whose sum is not the lane's own
    goes to the engine, and every result is exact."""
    import threading

    r, n = hvd.rank(), hvd.size()
    errors = []

    def work(t):
        try:
            for step in range(25):
                x = data(r, step + t, (50 + t,), torch.float32)
                hvd.allreduce_(x, name=f"thread{t}.{step % 3}", op=hvd.Sum)
                np.testing.assert_array_equal(
                    x.numpy(), want(n, step + t, (50 + t,), torch.float32, hvd.Sum, 1.0, hvd))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(f"thread {t}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not any(th.is_alive() for th in threads), "a thread is still waiting"
    assert not errors, errors


def a_join_hands_the_lanes_cycle_to_the_engine(hvd):
    """The last rank joins while the others run an armed op: the lane sees the join in
    its coordination, hands the cycle over, and the op sums the others' inputs."""
    r, n = hvd.rank(), hvd.size()
    last = n - 1
    for step in range(3):
        hvd.allreduce_(data(r, step, (100,), torch.float32), name="before.join", op=hvd.Sum)
    handovers = hvd.metrics()["engine_lane_handovers"]
    if r == last:
        joined = hvd.join()
    else:
        x = data(r, 9, (100,), torch.float32)
        hvd.allreduce_(x, name="before.join", op=hvd.Sum)
        np.testing.assert_array_equal(
            x.numpy(), want(n, 9, (100,), torch.float32, hvd.Sum, 1.0, hvd, ranks=range(last)))
        got = hvd.metrics()["engine_lane_handovers"] - handovers
        joined = hvd.join()
        assert got >= 1 if lane_on() else got == 0, got
    assert joined in range(last), joined  # the ranks still in the lane joined after it


def a_new_shape_on_one_rank_is_a_mismatch_on_every_rank(hvd):
    """After the name is armed everywhere, rank 1 changes its shape: the ranks still in the
    lane hand the cycle over and every rank raises the MismatchError naming the tensor."""
    r = hvd.rank()
    for step in range(3):
        hvd.allreduce_(torch.ones(4), name="mm.lane", op=hvd.Sum)
    try:
        hvd.allreduce_(torch.ones(5 if r == 1 else 4), name="mm.lane", op=hvd.Sum)
    except hvd.MismatchError as exc:
        text = str(exc)
        assert "'allreduce.mm.lane'" in text and re.search(r"rank 1\b", text), text
    else:
        raise AssertionError("no MismatchError")


def lane_tensors(hvd) -> int:
    return int(hvd.metrics()["engine_lane_tensors"])


def async_ops_run_in_the_lane_in_batches(hvd):
    """A step's named allreduce_async_ ops (three dtypes, Sum, Average and a postscale,
    sizes around a small fusion buffer), synchronized in another order than submitted:
    every result exact, and once each name ran through the engine the lane runs them all,
    several in one batch cycle."""
    r, n = hvd.rank(), hvd.size()
    specs = [(f"batch.{i}", (3 + 37 * i,), DTYPES[i % 3], (hvd.Sum, hvd.Average)[i % 2],
              0.5 if i % 5 == 4 and DTYPES[i % 3] != torch.float16 else 1.0) for i in range(24)]
    before_t, before_c = lane_tensors(hvd), lane_cycles(hvd)
    for step in range(6):
        xs = [data(r, step, shape, dtype) for _, shape, dtype, _, _ in specs]
        hs = [hvd.allreduce_async_(x, name=name, op=op, postscale_factor=post)
              for x, (name, _, _, op, post) in zip(xs, specs)]
        for i in [*range(1, len(hs), 2), *range(0, len(hs), 2)]:
            assert hvd.synchronize(hs[i]) is xs[i]
        for x, (name, shape, dtype, op, post) in zip(xs, specs):
            np.testing.assert_array_equal(x.numpy(), want(n, step, shape, dtype, op, post, hvd),
                                          err_msg=f"{name} step {step}")
    ran, cycles = lane_tensors(hvd) - before_t, lane_cycles(hvd) - before_c
    if lane_on():
        assert ran >= 4 * len(specs) and cycles < ran, (ran, cycles)
    else:
        assert ran == 0, ran


def grouped_allreduces_run_in_the_lane(hvd):
    """Named groups, in place and into new tensors (the inputs untouched), three dtypes,
    Sum and Average: every result exact, and from each group's second step on the lane
    runs its members; an unnamed group (a new name each call) stays on the engine's path."""
    r, n = hvd.rank(), hvd.size()
    shapes = [((5,), torch.float32), ((3, 7), torch.float64), ((40,), torch.float16), ((1,), torch.float32)]
    before = lane_tensors(hvd)
    for step in range(5):
        for op in (hvd.Sum, hvd.Average):
            xs = [data(r, step, shape, dtype) for shape, dtype in shapes]
            got = hvd.grouped_allreduce(xs, name=f"group.{int(op)}", op=op)
            for x, g, (shape, dtype) in zip(xs, got, shapes):
                assert g.data_ptr() != x.data_ptr() and g.dtype == dtype and g.shape == shape
                np.testing.assert_array_equal(x.numpy(), data(r, step, shape, dtype).numpy())
                np.testing.assert_array_equal(g.numpy(), want(n, step, shape, dtype, op, 1.0, hvd))
            ys = [data(r, step, shape, dtype) for shape, dtype in shapes]
            h = hvd.grouped_allreduce_async_(ys, name=f"group_.{int(op)}", op=op)
            assert all(a is b for a, b in zip(hvd.synchronize(h), ys))
            for y, (shape, dtype) in zip(ys, shapes):
                np.testing.assert_array_equal(y.numpy(), want(n, step, shape, dtype, op, 1.0, hvd))
    ran = lane_tensors(hvd) - before
    assert ran >= 4 * 2 * 2 * len(shapes) if lane_on() else ran == 0, ran
    before = lane_tensors(hvd)
    for step in range(3):
        got = hvd.grouped_allreduce([data(r, step, (6,), torch.float32)], op=hvd.Sum)
        np.testing.assert_array_equal(got[0].numpy(), want(n, step, (6,), torch.float32, hvd.Sum, 1.0, hvd))
    assert lane_tensors(hvd) == before


def a_poll_loop_and_a_new_name_finish_lane_ops(hvd):
    """Ops queued in the lane finish under a loop of poll() (nobody synchronizes: the
    engine's thread takes them over), and beside a name new on one rank only, whose
    announcement the lane hands to the engine."""
    r, n = hvd.rank(), hvd.size()
    for step in range(4):
        x = data(r, step, (64,), torch.float32)
        h = hvd.allreduce_async_(x, name="polled", op=hvd.Sum)
        while not hvd.poll(h):
            pass
        hvd.synchronize(h)
        np.testing.assert_array_equal(x.numpy(), want(n, step, (64,), torch.float32, hvd.Sum, 1.0, hvd))
    for step in range(4):
        x = data(r, step, (33,), torch.float64)
        h = hvd.allreduce_async_(x, name="steady", op=hvd.Average)
        extra = None
        if step == 2:  # a new name, submitted first on rank 0, later on the others
            y = data(r, step, (5,), torch.float32)
            if r == 0:
                extra = hvd.allreduce_async_(y, name="newcomer", op=hvd.Sum)
            hvd.synchronize(h)
            if r != 0:
                extra = hvd.allreduce_async_(y, name="newcomer", op=hvd.Sum)
            hvd.synchronize(extra)
            np.testing.assert_array_equal(y.numpy(), want(n, step, (5,), torch.float32, hvd.Sum, 1.0, hvd))
        hvd.synchronize(h)
        np.testing.assert_array_equal(x.numpy(), want(n, step, (33,), torch.float64, hvd.Average, 1.0, hvd))


def uneven_async_steps_end_in_a_join(hvd):
    """Rank r runs 2 + r steps of async ops, then joins: the ranks still stepping see the
    joins in their batch cycles, the engine takes the ops over and sums the ranks that
    still give data."""
    r, n = hvd.rank(), hvd.size()
    for step in range(2 + r):
        x = data(r, step, (40,), torch.float32)
        hvd.synchronize(hvd.allreduce_async_(x, name="uneven", op=hvd.Sum))
        ranks = [q for q in range(n) if 2 + q > step]
        np.testing.assert_array_equal(
            x.numpy(), want(n, step, (40,), torch.float32, hvd.Sum, 1.0, hvd, ranks=ranks))
    assert hvd.join() == n - 1


CHECKS = [named_ops_run_in_the_lane_and_match_numpy, one_name_with_new_shapes_and_dtypes_still_matches,
          horovods_metric_average_runs_in_the_lane,
          ops_outside_the_lane_still_match_and_leave_it_alone, gradients_flow_through_a_named_allreduce,
          pending_async_ops_and_the_lane_share_cycles, threads_with_their_own_names_share_the_lane,
          a_join_hands_the_lanes_cycle_to_the_engine,
          async_ops_run_in_the_lane_in_batches, grouped_allreduces_run_in_the_lane,
          a_poll_loop_and_a_new_name_finish_lane_ops,
          uneven_async_steps_end_in_a_join,
          a_new_shape_on_one_rank_is_a_mismatch_on_every_rank]


def run_all(lane_off_on=()) -> dict:
    """Every check in one init; the ranks in lane_off_on run with HOROVOD_SPARK_TORCH_LANE=0,
    so their engines' Python cycles pair with the others' lanes."""
    torch.set_num_threads(1)
    if int(os.environ["HVS_RANK"]) in lane_off_on:
        os.environ["HOROVOD_SPARK_TORCH_LANE"] = "0"
    import horovod_spark.torch as hvd
    hvd.init()
    results = run_checks(CHECKS, hvd)
    results["lane_cycles"] = lane_cycles(hvd)
    hvd.shutdown()
    return results


def a_lost_peer_fails_the_blocking_op(workdir: str, queued: bool = False) -> None:
    """Rank 1 exits while rank 0 waits in the lane, under default settings: rank 0's op
    raises the cause naming rank 1, and later ops raise at once.  queued: the ops are
    allreduce_async_ (rank 0 waits in the lane's batch cycle; a second queued op fails too)."""
    import json
    import time

    import horovod_spark.torch as hvd
    hvd.init()
    r = hvd.rank()

    def op(t, name):
        if queued:
            return hvd.synchronize(hvd.allreduce_async_(t, name=name, op=hvd.Sum))
        return hvd.allreduce_(t, name=name, op=hvd.Sum)
    for step in range(3):
        op(torch.ones(100), "lost")
        op(torch.ones(10), "lost.second")
    if r == 1:
        os._exit(0)
    t0 = time.perf_counter()
    second = hvd.allreduce_async_(torch.ones(10), name="lost.second", op=hvd.Sum) if queued else None
    try:
        op(torch.ones(100), "lost")
        first = "no error"
    except Exception as exc:
        first = f"{type(exc).__name__}: {exc}"
    took = time.perf_counter() - t0
    try:
        hvd.allreduce_(torch.ones(3), name="after", op=hvd.Sum)
        later = "no error"
    except Exception as exc:
        later = f"{type(exc).__name__}: {exc}"
    if second is not None:
        try:
            hvd.synchronize(second)
            later += " | second: no error"
        except Exception as exc:
            later += f" | second: {type(exc).__name__}"
    with open(os.path.join(workdir, "lost.json"), "w") as f:
        json.dump({"first": first, "later": later, "took": took}, f)
    hvd.shutdown()
