"""The fusion engine's checks, run inside every rank of one launch.

`run_all(overrides, workdir)` builds a communicator and an engine, runs every
check in order and returns {check name: "ok" or the failure text}.  Every
rank can compute every rank's input (inputs are seeded by rank), so each
rank checks its own results against numpy.  Every wait has a timeout: a
broken check fails, it never hangs the launch.
"""
from __future__ import annotations

import json
import logging
import os
import re
import time
import traceback

import numpy as np

import collectives
from collectives import CollectiveError, MismatchError, ReduceOp
from collectives.fusion import FusionEngine
from collectives.types import DType

WAIT = 30.0
FLOATS = (np.float16, np.float32, np.float64)
INTS = (np.int32, np.int64, np.uint8)


def data(rank: int, n: int, dtype, tag: int = 0) -> np.ndarray:
    rng = np.random.default_rng(1000 * tag + rank)
    if np.dtype(dtype).kind == "f":
        return rng.uniform(-2, 2, n).astype(dtype)
    return rng.integers(1, 4, n).astype(dtype)


def reference(size: int, n: int, dtype, op: ReduceOp, tag: int = 0) -> np.ndarray:
    xs = np.stack([data(r, n, dtype, tag).astype(np.float64) for r in range(size)])
    fn = {ReduceOp.SUM: np.sum, ReduceOp.AVERAGE: np.mean, ReduceOp.MIN: np.min,
          ReduceOp.MAX: np.max, ReduceOp.PRODUCT: np.prod}[op]
    return fn(xs, axis=0)


def close(got, want, dtype) -> None:
    tol = {np.dtype(np.float16): 2e-2, np.dtype(np.float32): 1e-5}.get(np.dtype(dtype), 1e-9)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol * 4)


def bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (round to nearest even), as uint16."""
    u = x.astype(np.float32).view(np.uint32)
    return ((u + ((u >> 16) & 1) + 0x7FFF) >> 16).astype(np.uint16)


def from_bf16(u: np.ndarray) -> np.ndarray:
    return (u.astype(np.uint32) << 16).view(np.float32)


def a2a_input(rank: int, size: int):
    """Rank `rank` sends (rank + j) % 3 rows to rank j."""
    splits = [(rank + j) % 3 for j in range(size)]
    return splits, np.arange(sum(splits), dtype=np.int32) + 100 * rank


def names_every_rank(text: str, size: int) -> bool:
    """Every rank appears in a listing like 'rank 0: ...; ranks 1,2: ...'."""
    listed = set()
    for group in re.findall(r"ranks? ([\d,]+):", text):
        listed.update(int(k) for k in group.split(","))
    return listed == set(range(size))


# -- checks -------------------------------------------------------------------
def allreduce_every_op_and_dtype_matches_numpy(eng, comm):
    jobs = []
    for dtype in FLOATS + INTS:
        ops = [ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT]
        ops += [ReduceOp.AVERAGE] if np.dtype(dtype).kind == "f" else []
        for op in ops:
            for n in (0, 1, 7, 1000):
                name = f"ar.{np.dtype(dtype).name}.{op.name}.{n}"
                h = eng.submit(name, "allreduce", data(comm.rank, n, dtype), op=op)
                jobs.append((h, reference(comm.size, n, dtype, op), dtype, name))
    for h, want, dtype, name in jobs:
        got = h.wait(WAIT)
        assert got.dtype == np.dtype(dtype), (name, got.dtype)
        close(got, want, dtype)


def bfloat16_buffers_reduce_through_a_dtype_tag(eng, comm):
    x = data(comm.rank, 33, np.float32)
    got = eng.submit("bf16.sum", "allreduce", bf16(x), dtype=DType.BFLOAT16).wait(WAIT)
    inplace = bf16(x)
    eng.submit("bf16.avg", "allreduce", inplace, out=inplace, op=ReduceOp.AVERAGE,
               dtype=DType.BFLOAT16).wait(WAIT)
    want = sum(from_bf16(bf16(data(r, 33, np.float32))) for r in range(comm.size))
    np.testing.assert_allclose(from_bf16(got), want, rtol=1e-2, atol=2e-2)
    np.testing.assert_allclose(from_bf16(inplace), want / comm.size, rtol=1e-2, atol=2e-2)


def scale_factors_and_in_place_results_match_numpy(eng, comm):
    x = data(comm.rank, 100, np.float64)
    out = np.empty_like(x)
    h1 = eng.submit("scale.out", "allreduce", x, out=out, prescale=0.5, postscale=3.0)
    y = x.copy()
    h2 = eng.submit("scale.inplace", "allreduce", y, out=y, op=ReduceOp.AVERAGE, prescale=2.0)
    assert h1.wait(WAIT) is out and h2.wait(WAIT) is y
    want = reference(comm.size, 100, np.float64, ReduceOp.SUM)
    close(out, want * 1.5, np.float64)
    close(y, want * 2.0 / comm.size, np.float64)
    close(x, data(comm.rank, 100, np.float64), np.float64)  # the input of out= is untouched


def fusion_packs_a_burst_into_few_collectives(eng, comm):
    before = eng.metrics()
    xs = [data(comm.rank, 256, np.float32, tag=i) for i in range(64)]
    hs = [eng.submit(f"burst.{i}", "allreduce", x, out=x) for i, x in enumerate(xs)]
    for i, h in enumerate(hs):
        h.wait(WAIT)
        close(xs[i], reference(comm.size, 256, np.float32, ReduceOp.SUM, tag=i), np.float32)
    after = eng.metrics()
    collectives_used = after["collectives"] - before["collectives"]
    assert after["fused_buffers"] > before["fused_buffers"], (before, after)
    assert collectives_used <= 32, f"64 tensors took {collectives_used} collectives"
    threshold = eng._config.fusion_threshold
    assert collectives_used >= -(-64 * 256 * 4 // threshold), (collectives_used, threshold)


def adasum_is_an_allreduce_op_fused_per_tensor(eng, comm):
    """op=ADASUM: a burst of tensors is fused, each combined with its own dot products as
    collectives.adasum's tree; scale factors apply; wrong uses raise at the call."""
    from collectives import NotSupported, adasum

    r, n = comm.rank, comm.size
    if n & (n - 1):
        try:
            eng.submit("adasum.odd", "allreduce", np.ones(4, np.float32), op=ReduceOp.ADASUM)
        except NotSupported as exc:
            assert f"has {n}" in str(exc) and "power-of-two" in str(exc), exc
        else:
            raise AssertionError(f"Adasum was accepted on {n} ranks")
        return
    sizes = [3, 1000, 1, 257, 40, 4096] * 2
    rows = [np.stack([data(q, k, np.float32, tag=50 + i) * (1 + 10 * i) for q in range(n)])
            for i, k in enumerate(sizes)]
    before = eng.metrics()
    hs = [eng.submit(f"adasum.{i}", "allreduce", rows[i][r].copy(), op=ReduceOp.ADASUM,
                     prescale=2.0 if i == 1 else 1.0, postscale=0.25 if i == 1 else 1.0)
          for i in range(len(sizes))]
    for i, h in enumerate(hs):
        want = adasum.tree(rows[i] * (2.0 if i == 1 else 1.0)) * (0.25 if i == 1 else 1.0)
        np.testing.assert_allclose(h.wait(WAIT), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    assert eng.metrics()["fused_buffers"] > before["fused_buffers"], (before, eng.metrics())
    for kind, x, err in (("allreduce", np.ones(4, np.int32), TypeError),
                         ("reducescatter", np.ones(4, np.float32), ValueError)):
        try:
            eng.submit(f"adasum.bad.{kind}", kind, x, op=ReduceOp.ADASUM)
        except err as exc:
            assert "Adasum" in str(exc), exc
        else:
            raise AssertionError(f"{kind} of {x.dtype} with Adasum was accepted")


def steady_state_needs_no_negotiation(eng, comm):
    """Names seen once are cached: the second round costs only bit-vector cycles."""
    def one_round():
        xs = [np.full(8, float(i)) for i in range(20)]
        for h in [eng.submit(f"steady.{i}", "allreduce", x, out=x) for i, x in enumerate(xs)]:
            h.wait(WAIT)
        assert all((x == i * comm.size).all() for i, x in enumerate(xs))
    one_round()
    before = eng.metrics()["negotiations"]
    one_round()
    assert eng.metrics()["negotiations"] == before, (before, eng.metrics())


def ranks_may_submit_in_different_orders(eng, comm):
    names = [f"order.{i}" for i in range(40)]
    order = np.random.default_rng(comm.rank).permutation(40)
    hs = {}
    for i in order:
        dtype = (np.float32, np.float64, np.int32)[i % 3]
        hs[i] = (eng.submit(names[i], "allreduce", data(comm.rank, 10 + i, dtype, tag=i)), dtype)
    for i, (h, dtype) in hs.items():
        close(h.wait(WAIT), reference(comm.size, 10 + i, dtype, ReduceOp.SUM, tag=i), dtype)


def the_other_kinds_match_numpy(eng, comm):
    r, n = comm.rank, comm.size
    rows = np.arange(r + 1, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32) + r
    got = eng.submit("ag.rows", "allgather", rows).wait(WAIT)
    want = np.concatenate([np.arange(k + 1, dtype=np.float32)[:, None] * np.ones((1, 3)) + k
                           for k in range(n)])
    np.testing.assert_array_equal(got, want)
    for root in range(n):
        x = np.full(5, r * 10 + 1, np.int64)
        assert eng.submit(f"bc.{root}", "broadcast", x, out=x, root=root).wait(WAIT) is x
        np.testing.assert_array_equal(x, np.full(5, root * 10 + 1))
    x = data(r, (2 * n + 1) * 2, np.float64).reshape(2 * n + 1, 2)
    mine = eng.submit("rs.avg", "reducescatter", x, op=ReduceOp.AVERAGE).wait(WAIT)
    full = reference(n, (2 * n + 1) * 2, np.float64, ReduceOp.AVERAGE).reshape(2 * n + 1, 2)
    start = sum(3 if k == 0 else 2 for k in range(r))  # the first rank gets the extra row
    close(mine, full[start:start + (3 if r == 0 else 2)], np.float64)
    splits, src = a2a_input(r, n)
    out, recv = eng.submit("a2a", "alltoall", src, splits=splits).wait(WAIT)
    want = []
    for k in range(n):
        ks, ksrc = a2a_input(k, n)
        want.append(ksrc[sum(ks[:r]):sum(ks[:r]) + ks[r]])
    np.testing.assert_array_equal(out, np.concatenate(want))
    assert list(recv) == [a2a_input(k, n)[0][r] for k in range(n)], recv
    eng.submit("barrier.1", "barrier").wait(WAIT)


def scalars_and_empty_tensors_work(eng, comm):
    s = eng.submit("scalar", "allreduce", np.float64(comm.rank + 1.0)).wait(WAIT)
    assert s.shape == () and float(s) == sum(range(1, comm.size + 1))
    e = eng.submit("empty", "allreduce", np.zeros((0, 4), np.float32)).wait(WAIT)
    assert e.shape == (0, 4)
    rows = np.ones((1 if comm.rank == 0 else 0, 2), np.int32)
    assert eng.submit("ag.sparse", "allgather", rows).wait(WAIT).shape == (1, 2)


def wrong_arguments_raise_at_the_call(eng, comm):
    for bad, exc in [(lambda: eng.submit("k", "allsum", np.ones(1)), ValueError),
                     (lambda: eng.submit("k", "broadcast", np.ones(1), root=comm.size), ValueError),
                     (lambda: eng.submit("k", "allreduce", np.ones(1, np.int32),
                                         op=ReduceOp.AVERAGE), TypeError),
                     (lambda: eng.submit("k", "alltoall", np.ones(3), splits=[4] * comm.size),
                      ValueError)]:
        try:
            bad()
        except exc as e:
            assert "'k'" in str(e), str(e)
        else:
            raise AssertionError(f"no {exc.__name__}")


def a_name_already_pending_is_refused(eng, comm):
    """Rank 0's 'dup' stays pending until rank 1 submits it, after 'dup.go'."""
    if comm.rank == 0:
        h = eng.submit("dup", "allreduce", np.ones(1))
        try:
            eng.submit("dup", "allreduce", np.ones(1))
        except ValueError as e:
            assert "'dup'" in str(e) and "already pending" in str(e), str(e)
        else:
            raise AssertionError("a second pending 'dup' was accepted")
        eng.submit("dup.go", "barrier").wait(WAIT)
    else:
        eng.submit("dup.go", "barrier").wait(WAIT)
        h = eng.submit("dup", "allreduce", np.ones(1))
    assert (h.wait(WAIT) == comm.size).all()
    eng.submit("dup", "allreduce", np.ones(1)).wait(WAIT)  # the name is free again


def mismatches_raise_on_every_rank_naming_tensor_and_ranks(eng, comm):
    r = comm.rank
    eng.submit("mm.cached", "allreduce", np.ones(4, np.float32)).wait(WAIT)  # cached now
    cases = {
        "mm.shape": lambda: eng.submit("mm.shape", "allreduce", np.ones(4 + r, np.float32)),
        "mm.dtype": lambda: eng.submit("mm.dtype", "allreduce", np.ones(4, np.float32 if r == 0
                                                                        else np.float64)),
        "mm.op": lambda: eng.submit("mm.op", "allreduce", np.ones(4),
                                    op=ReduceOp.SUM if r == 0 else ReduceOp.MAX),
        "mm.cached": lambda: eng.submit("mm.cached", "allreduce", np.ones(4 + (r == 1), np.float32)),
    }
    t0 = time.perf_counter()
    for name, submit in cases.items():
        try:
            submit().wait(WAIT)
        except MismatchError as exc:
            text = str(exc)
            assert f"'{name}'" in text and f"on rank {r}/" in text, text
            assert names_every_rank(text, comm.size), text
        else:
            raise AssertionError(f"{name}: no MismatchError")
    assert time.perf_counter() - t0 < 20, "mismatches took too long to surface"
    good = eng.submit("mm.after", "allreduce", np.ones(2)).wait(WAIT)
    assert (good == comm.size).all()  # the engine carries on


def join_lets_ranks_run_uneven_step_counts(eng, comm):
    r, n = comm.rank, comm.size
    for step in range(2 + r):
        got = eng.submit(f"join.step{step}", "allreduce", np.ones(3, np.float32)).wait(WAIT)
        active = sum(1 for k in range(n) if 2 + k > step)
        assert (got == active).all(), (step, got, active)
        rows = eng.submit(f"join.ag{step}", "allgather", np.full((1, 2), r, np.int64)).wait(WAIT)
        assert rows[:, 0].tolist() == [k for k in range(n) if 2 + k > step], rows
    last = eng.join(WAIT)
    assert last == n - 1, last
    assert (eng.submit("join.after", "allreduce", np.ones(1)).wait(WAIT) == n).all()


def a_stalled_tensor_is_reported_with_the_missing_ranks(eng, comm):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("collectives.fusion")
    log.addHandler(handler)
    try:
        eng.submit("stall.sync", "barrier").wait(WAIT)
        if comm.rank != 0:
            time.sleep(2 * eng._config.stall_check_time + 0.5)
        eng.submit("stall.x", "allreduce", np.ones(2)).wait(WAIT)
    finally:
        log.removeHandler(handler)
    if comm.rank == 0:
        texts = [rec.getMessage() for rec in records if "stall.x" in rec.getMessage()]
        missing = list(range(1, comm.size))
        assert any(f"not yet by ranks {missing}" in t for t in texts), texts


def a_stall_past_the_shutdown_time_fails_the_op(eng, comm):
    """HOROVOD_STALL_SHUTDOWN_TIME_SECONDS: rank 0's op fails; the others never submit it.

    Until a common deadline after the failure, no rank submits anything else
    (it would stall too); then every rank goes on together.
    """
    eng.submit("never.sync", "barrier").wait(WAIT)
    deadline = time.perf_counter() + eng._config.stall_shutdown_time + \
        3 * eng._config.stall_check_time + 1.0
    if comm.rank == 0:
        try:
            eng.submit("never", "allreduce", np.ones(2)).wait(WAIT)
        except CollectiveError as exc:
            text = str(exc)
            missing = list(range(1, comm.size))
            assert type(exc).__name__ == "CollectiveTimeout", type(exc)
            assert "'never'" in text and f"not yet by ranks {missing}" in text, text
        else:
            raise AssertionError("a tensor stalled past the shutdown time did not fail")
    time.sleep(max(0.0, deadline - time.perf_counter()))
    assert (eng.submit("never.after", "allreduce", np.ones(1)).wait(WAIT) == comm.size).all()


def the_timeline_is_chrome_trace_json_with_every_phase(eng, comm, workdir):
    path = os.path.join(workdir, "timeline.json")
    eng.start_timeline(path, mark_cycles=True)
    xs = [np.ones(64, np.float32) for _ in range(16)]
    for h in [eng.submit(f"tl.{i}", "allreduce", x, out=x) for i, x in enumerate(xs)]:
        h.wait(WAIT)
    eng.submit("tl.bcast", "broadcast", np.ones(3), root=0).wait(WAIT)
    eng.submit("tl.sync", "barrier").wait(WAIT)
    eng.stop_timeline()
    if comm.rank != 0:  # rank 0 alone writes the timeline
        return
    with open(path) as f:
        events = json.load(f)
    tensors = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert {f"tl.{i}" for i in range(16)} <= tensors, tensors
    phases = {e["name"] for e in events if e.get("ph") == "X"}
    want = {"NEGOTIATE", "QUEUE", "MEMCPY_IN_FUSION_BUFFER", "ALLREDUCE",
            "MEMCPY_OUT_FUSION_BUFFER", "BROADCAST"}
    assert want <= phases, phases
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in events if e.get("ph") == "X")
    assert any(e["name"] == "CYCLE_START" and e["ph"] == "i" for e in events)


def shutdown_on_one_rank_fails_the_others_ops_naming_it(eng, comm):
    eng.submit("sd.sync", "barrier").wait(WAIT)
    if comm.rank == 1:
        eng.shutdown()
        return
    try:
        eng.submit("sd.late", "allreduce", np.ones(1)).wait(WAIT)
    except CollectiveError as exc:
        assert "rank 1 returned from the function (or called hvd.shutdown())" in str(exc) \
            and f"rank {comm.rank}/" in str(exc), str(exc)
    else:
        raise AssertionError("no error after rank 1 shut down")


def waiting_callers_run_the_cycles(eng, comm):
    """A caller that waits (no timeout) on a lazy submission runs the cycles itself; one
    that waits on an asynchronous submission leaves them to the engine's thread.  (Every
    rank runs both loops before it judges, so a failure can't leave the others waiting.)"""
    driven = {}
    for lazy in (True, False):
        eng.submit(f"drive.{lazy}.sync", "barrier", lazy=True).wait()  # the ranks in step
        before = eng.metrics()["caller_cycles"]
        for step in range(20):
            x = data(comm.rank, 257, np.float32, step)
            got = eng.submit(f"drive.{lazy}.{step}", "allreduce", x, op=ReduceOp.SUM,
                             lazy=lazy).wait()
            close(got, reference(comm.size, 257, np.float32, ReduceOp.SUM, step), np.float32)
        driven[lazy] = eng.metrics()["caller_cycles"] - before
    # (lazy: an op's first wait finds a cycle of the engine's thread running now and then)
    assert driven[True] >= 10, f"only {driven[True]} of 20 lazy ops ran cycles on the caller"
    assert driven[False] == 0, f"{driven[False]} asynchronous ops' cycles ran on the caller"


def threads_waiting_at_once_share_the_cycles(eng, comm):
    """Four threads per rank, each a stream of synchronous ops, started in another order on
    every rank: each thread either drives or is finished by whoever does; all results right."""
    import threading

    errors, size = [], comm.size

    def stream(t):
        try:
            for step in range(15):
                tag = 100 + 10 * t + step
                got = eng.submit(f"threads.{t}.{step}", "allreduce", data(comm.rank, 33, np.float64, tag),
                                 op=ReduceOp.SUM, lazy=step % 2 == 0).wait()
                close(got, reference(size, 33, np.float64, ReduceOp.SUM, tag), np.float64)
        except Exception:
            errors.append(traceback.format_exc())

    order = list(range(4))
    if comm.rank % 2:
        order.reverse()
    threads = [threading.Thread(target=stream, args=(t,), daemon=True) for t in order]
    for th in threads:
        th.start()
    for th in threads:
        th.join(WAIT)
    assert not any(th.is_alive() for th in threads), "a waiting thread never finished"
    assert not errors, "\n".join(errors)


def a_lazy_op_nobody_waits_for_still_finishes(eng, comm):
    """lazy only spares the engine's thread a wake-up: its heartbeat still runs the op."""
    h = eng.submit("lazy.unwaited", "allreduce", np.full(5, comm.rank + 1.0), lazy=True)
    deadline = time.monotonic() + WAIT
    while not h.poll():
        assert time.monotonic() < deadline, "a lazy op nobody waited for never finished"
        time.sleep(0.005)
    np.testing.assert_array_equal(h.wait(0), np.full(5, comm.size * (comm.size + 1) / 2))


def a_wait_with_a_timeout_times_out_then_the_op_finishes(eng, comm):
    """A wait with a timeout never blocks past it in a cycle, even when the peers are late."""
    from collectives import CollectiveTimeout

    if comm.rank != 0:
        time.sleep(0.5)
    h = eng.submit("late.peers", "allreduce", np.ones(3), lazy=True)
    if comm.rank == 0:
        t0 = time.monotonic()
        try:
            h.wait(0.1)
            raise AssertionError("the wait did not time out although the peers had not submitted")
        except CollectiveTimeout as exc:
            assert "late.peers" in str(exc), str(exc)
        assert time.monotonic() - t0 < 0.4, "a 0.1 s wait blocked in a cycle until the peers came"
    np.testing.assert_array_equal(h.wait(), np.full(3, float(comm.size)))


def a_caller_cycle_keeps_the_engines_numpy_error_handling(eng, comm):
    """A caller that asks numpy to raise on underflow still gets its float16 average:
    the cycle it runs scales with numpy's defaults, as the engine's thread would."""
    x = np.full(8, 6e-8, np.float16)  # halving it underflows
    with np.errstate(all="raise"):
        got = eng.submit("errstate.avg", "allreduce", x, op=ReduceOp.AVERAGE, lazy=True).wait()
    np.testing.assert_allclose(np.asarray(got, np.float64), 6e-8, rtol=0.5)


def a_caller_cycle_in_inference_mode_finishes_other_ops_as_plain_tensors(eng, comm):
    """Rank's main thread waits on an op inside torch.inference_mode() and so runs the cycle
    that also finishes an op submitted before it: that op's result is a plain tensor."""
    try:
        import torch
    except ImportError:
        return
    other = eng.submit("inference.other", "allreduce", torch.ones(16))
    with torch.inference_mode():
        eng.submit("inference.mine", "allreduce", torch.ones(4), lazy=True).wait()
    result = other.wait()
    assert not result.is_inference(), "another op's result was made an inference tensor"
    result.add_(1)  # fails on an inference tensor outside inference mode


def a_name_resubmitted_with_a_changed_tensor_takes_the_new_one(eng, comm):
    """The memo of a name's last torch request (request.Memo) is reused only for the same
    tensor with the same storage, shape and dtype: a parameter whose .data was replaced,
    a tensor resized in place, another tensor or other arguments under the same name are
    checked afresh, and each result lands where that step's tensor lives."""
    try:
        import torch
    except ImportError:
        return
    n = comm.size
    t = torch.full((8,), 1.0 + comm.rank)
    for _ in range(2):  # the second submission reuses the memo
        eng.submit("memo.t", "allreduce", t, out=t).wait(WAIT)
        t.fill_(1.0 + comm.rank)
    old = t.data
    t.data = torch.full((8,), 10.0 * (comm.rank + 1))  # new storage, the same object
    assert eng.submit("memo.t", "allreduce", t, out=t).wait(WAIT) is t
    assert (t == 10.0 * n * (n + 1) / 2).all(), t
    assert (old == 1.0 + comm.rank).all(), "the old storage was written"
    t.resize_(4)  # in place, another shape: a new signature (every rank alike)
    t.fill_(1.0)
    assert (eng.submit("memo.t", "allreduce", t, out=t).wait(WAIT) == n).all() and t.shape == (4,)
    u = torch.ones(4)
    got = eng.submit("memo.t", "allreduce", u).wait(WAIT)  # another tensor, not in place
    assert got is not u and (got == n).all() and (u == 1).all(), (got, u)
    got = eng.submit("memo.t", "allreduce", u, op=ReduceOp.AVERAGE).wait(WAIT)  # other arguments
    assert (got == 1).all(), got
    try:
        eng.submit("memo.t", "allreduce", torch.ones(4, dtype=torch.int32), op=ReduceOp.AVERAGE)
    except TypeError:
        pass  # refused at the call, as without a memo
    else:
        raise AssertionError("AVERAGE of an int32 tensor was accepted")


CHECKS = [allreduce_every_op_and_dtype_matches_numpy, bfloat16_buffers_reduce_through_a_dtype_tag,
          scale_factors_and_in_place_results_match_numpy, fusion_packs_a_burst_into_few_collectives,
          adasum_is_an_allreduce_op_fused_per_tensor,
          a_name_resubmitted_with_a_changed_tensor_takes_the_new_one,
          steady_state_needs_no_negotiation, ranks_may_submit_in_different_orders,
          the_other_kinds_match_numpy,
          scalars_and_empty_tensors_work, wrong_arguments_raise_at_the_call,
          a_name_already_pending_is_refused,
          mismatches_raise_on_every_rank_naming_tensor_and_ranks,
          join_lets_ranks_run_uneven_step_counts,
          a_stalled_tensor_is_reported_with_the_missing_ranks,
          the_timeline_is_chrome_trace_json_with_every_phase,
          waiting_callers_run_the_cycles, threads_waiting_at_once_share_the_cycles,
          a_caller_cycle_keeps_the_engines_numpy_error_handling,
          a_caller_cycle_in_inference_mode_finishes_other_ops_as_plain_tensors,
          a_lazy_op_nobody_waits_for_still_finishes,
          a_wait_with_a_timeout_times_out_then_the_op_finishes,
          shutdown_on_one_rank_fails_the_others_ops_naming_it]


def run_all(overrides: dict, workdir: str) -> dict:
    comm = collectives.init(collectives.Config.create(overrides))
    eng = FusionEngine(comm)
    results = {}
    for check in CHECKS:
        args = (eng, comm, workdir) if "workdir" in check.__code__.co_varnames else (eng, comm)
        try:
            check(*args)
            results[check.__name__] = "ok"
        except Exception:
            results[check.__name__] = traceback.format_exc()
    eng.shutdown()
    # A check that needs its own engine settings gets a fresh engine on the same comm.
    eng = FusionEngine(comm, comm.config.replace(stall_check_time=0.5, stall_shutdown_time=1.5))
    try:
        a_stall_past_the_shutdown_time_fails_the_op(eng, comm)
        results["a_stall_past_the_shutdown_time_fails_the_op"] = "ok"
    except Exception:
        results["a_stall_past_the_shutdown_time_fails_the_op"] = traceback.format_exc()
    eng.shutdown()
    comm.close()
    return results


def lose_a_peer(workdir: str, timeout) -> None:
    """Rank 1 dies mid-job; rank 0 records what its pending op failed with.  With
    timeout None rank 0's own thread runs the failing cycle, else the engine's thread."""
    comm = collectives.init(collectives.Config.create({"timeout": 5.0}))
    eng = FusionEngine(comm)
    eng.submit("lp.sync", "barrier").wait(WAIT)
    if comm.rank == 1:
        os._exit(7)
    try:
        eng.submit("lp.x", "allreduce", np.ones(4), lazy=timeout is None).wait(timeout)
        text = "no error"
    except CollectiveError as exc:
        text = f"{type(exc).__name__}: {exc}"
    try:
        eng.submit("lp.y", "allreduce", np.ones(4))
        text += "\nsubmit after the failure: no error"
    except CollectiveError as exc:
        text += f"\nsubmit after the failure: {type(exc).__name__}: {exc}"
    with open(os.path.join(workdir, "lost_peer.txt"), "w") as f:
        f.write(text)


def interrupt_a_waiting_caller(workdir: str, inside_cycle: bool) -> str:
    """Ctrl-C on rank 0 while it waits for an op that rank 1 has not submitted: the
    KeyboardInterrupt reaches rank 0's caller, never a hang.  inside_cycle: the signal
    comes while rank 0's own thread runs a cycle (sent from inside it), so the engine
    stops and says why; else half a second into the wait, wherever it is then."""
    import signal
    import threading

    comm = collectives.init(collectives.Config.create({"timeout": 20.0}))
    eng = FusionEngine(comm)
    eng.submit("ki.sync", "barrier").wait(WAIT)
    if comm.rank == 1:
        time.sleep(3.0)  # never submits ki.x; its engine's heartbeats keep cycling
        return "waited"
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if inside_cycle:
        vector, main = eng._vector, threading.get_ident()

        def signalled_vector():
            if threading.get_ident() == main:
                os.kill(os.getpid(), signal.SIGINT)  # handled at this thread's next bytecode
            return vector()

        eng._vector = signalled_vector
    else:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    t0 = time.monotonic()
    try:
        eng.submit("ki.x", "allreduce", np.ones(4), lazy=True).wait()
        return "no interrupt"
    except KeyboardInterrupt:
        text = f"interrupted after {time.monotonic() - t0:.1f} s"
    if inside_cycle:
        try:
            eng.submit("ki.y", "allreduce", np.ones(4))
            text += "; a later submit: no error"
        except CollectiveError as exc:
            text += f"; a later submit: {type(exc).__name__}: {exc}"
    return text


def a_signal_handler_waits_inside_the_callers_cycle(workdir: str) -> str:
    """A SIGUSR1 handler on rank 0 runs a barrier while rank 0's main thread is inside
    a cycle it drives: a clear error, not a deadlock (the cycle can't end first)."""
    import signal
    import threading

    comm = collectives.init(collectives.Config.create({"timeout": 20.0}))
    eng = FusionEngine(comm)
    eng.submit("sh.sync", "barrier").wait(WAIT)
    if comm.rank == 1:
        time.sleep(3.0)
        return "waited"
    signal.signal(signal.SIGUSR1, lambda *_: eng.submit("sh.barrier", "barrier").wait())
    vector, main = eng._vector, threading.get_ident()

    def signalled_vector():
        if threading.get_ident() == main:
            os.kill(os.getpid(), signal.SIGUSR1)
        return vector()

    eng._vector = signalled_vector
    t0 = time.monotonic()
    try:
        eng.submit("sh.x", "allreduce", np.ones(4), lazy=True).wait()
        return "no error"
    except CollectiveError as exc:
        return f"after {time.monotonic() - t0:.1f} s: {exc}"
