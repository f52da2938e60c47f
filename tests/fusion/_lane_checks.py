"""The fusion engine's lane (collectives/fusion/lane.py), run inside every rank.

Each function is one launch's body: it drives `lane.run` and `lane_op` the way
the TensorFlow op does (lane_op.cc) and returns what the test asserts on.
Every rank computes every rank's input, so each checks its results against
numpy.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np

import collectives
from collectives import ReduceOp, _native
from collectives.fusion import FusionEngine

DONE = _native.LANE_CODES["done"]
WAIT = 30.0


def data(rank: int, step: int, n: int, dtype) -> np.ndarray:
    return (np.arange(n) % 13 + rank + step).astype(dtype)


def expected(size: int, step: int, n: int, dtype, op: ReduceOp, post: float,
             joined=()) -> np.ndarray:
    total = sum(data(r, step, n, dtype) for r in range(size) if r not in joined)
    scale = post / size if op == ReduceOp.AVERAGE else post
    return total * dtype(scale)


def lane_allreduce(eng, slot: int, name: str, src: np.ndarray, op=ReduceOp.AVERAGE,
                   post: float = 1.0) -> tuple:
    """What the TensorFlow op does: the lane, else the engine; (result, lane code)."""
    dst = np.empty_like(src)
    code = eng.lane.run(slot, src, dst)
    if code != DONE:
        eng.lane_op(code, slot, name, src, dst, op, post)
    return dst, code


def steady_state(plan: str, steps: int = 60) -> dict:
    """Every rank runs `steps` allreduces of one name, each in the lane or through
    `submit` as `plan` says ('lane', 'python', or 'mixed': it depends on rank and
    step, so lane and Python cycles pair up across ranks), in float32, float64 and
    float16 (whose postscale rounds as numpy's does)."""
    comm = collectives.init()
    eng = FusionEngine(comm, lane=True)
    r, size = comm.rank, comm.size
    codes, bad = [], []
    for slot, (dtype, n, op, post) in enumerate(((np.float32, 80000, ReduceOp.AVERAGE, 1.0),
                                                 (np.float64, 1000, ReduceOp.SUM, 0.5),
                                                 (np.float16, 999, ReduceOp.AVERAGE, 1.0))):
        name = f"g.{np.dtype(dtype).name}"
        for step in range(steps):
            src = data(r, step, n, dtype)
            lane = plan == "lane" or (plan == "mixed" and (r + step) % 3 != 0)
            if lane:
                got, code = lane_allreduce(eng, slot, name, src, op, post)
                codes.append(code)
            else:
                got = np.empty_like(src)
                eng.submit(name, "allreduce", src, out=got, op=op, postscale=post,
                           lazy=True).wait(WAIT)
            want = expected(size, step, n, dtype, op, post)
            if not np.array_equal(got, want):
                bad.append((np.dtype(dtype).name, step, got[:3].tolist(), want[:3].tolist()))
            if step % 20 == 7:  # another op between: new names negotiate and move the cache
                eng.submit(f"other.{step}", "allreduce", np.ones(5), op=ReduceOp.SUM).wait(WAIT)
    m = eng.metrics()
    eng.shutdown()
    comm.close()
    return {"bad": bad, "codes": codes, "lane_cycles": m["lane_cycles"],
            "tensors": m["tensors"]}


def a_join_hands_the_cycle_over() -> dict:
    """The last rank joins while the others run an armed op in the lane: the lane's
    coordination sees the join, hands the cycle to the engine, and the op completes
    with zeros from the joined rank, as through `submit`."""
    comm = collectives.init()
    eng = FusionEngine(comm, lane=True)
    r, size = comm.rank, comm.size
    n, last = 1000, size - 1
    for step in range(3):  # armed, and in step
        lane_allreduce(eng, 0, "g", data(r, step, n, np.float32))
    out = {}
    if r == last:
        out["last_joined"] = eng.join(WAIT)
    else:
        got, code = lane_allreduce(eng, 0, "g", data(r, 9, n, np.float32))
        out["code"] = code
        out["equal"] = bool(np.array_equal(got, expected(size, 9, n, np.float32, ReduceOp.AVERAGE,
                                                         1.0, joined=(last,))))
        out["last_joined"] = eng.join(WAIT)
    out["handovers"] = eng.metrics()["lane_handovers"]
    eng.shutdown()
    comm.close()
    return out


def a_lost_peer_fails_the_lane_fast(workdir: str) -> None:
    """Rank 1 exits while rank 0 waits in the lane: rank 0's op fails with the cause, and
    the engine has stopped with it (later ops raise it at once)."""
    comm = collectives.init(collectives.Config.create({"timeout": 10.0}))
    eng = FusionEngine(comm, lane=True)
    r = comm.rank
    for step in range(3):
        lane_allreduce(eng, 0, "g", data(r, step, 100, np.float32))
    if r == 1:
        os._exit(0)
    t0 = time.perf_counter()
    try:
        lane_allreduce(eng, 0, "g", data(r, 5, 100, np.float32))
        first = "no error"
    except collectives.CollectiveError as exc:
        first = f"{type(exc).__name__}: {exc}"
    took = time.perf_counter() - t0
    try:
        eng.submit("after", "allreduce", np.ones(3)).wait(WAIT)
        later = "no error"
    except collectives.CollectiveError as exc:
        later = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(workdir, "lost.json"), "w") as f:
        json.dump({"first": first, "later": later, "took": took}, f)
    eng.shutdown(5.0)
    comm.close()


def a_new_signature_beside_the_lane_is_a_mismatch() -> dict:
    """The name is armed on every rank; then rank 1 submits it with another shape while the
    others run it in the lane.  Their lanes see rank 1's announcement and hand the cycle
    over; the announcement evicts the cached bit, so the handed-over request must announce
    its own signature next cycle: every rank gets the MismatchError (it hung before)."""
    comm = collectives.init()
    eng = FusionEngine(comm, lane=True)
    r = comm.rank
    for step in range(3):
        lane_allreduce(eng, 0, "g", data(r, step, 8, np.float32))
    try:
        if r == 1:
            eng.submit("g", "allreduce", data(r, 5, 9, np.float32), op=ReduceOp.AVERAGE,
                       lazy=True).wait(WAIT)
        else:
            lane_allreduce(eng, 0, "g", data(r, 5, 8, np.float32))
        out = {"error": "none"}
    except collectives.CollectiveError as exc:
        out = {"error": f"{type(exc).__name__}: {exc}"}
    out["handovers"] = eng.metrics()["lane_handovers"]
    eng.shutdown()
    comm.close()
    return out


def new_names_leave_other_slots_armed(steps: int = 20) -> dict:
    """Between runs of an armed op, a new name negotiates every step (an unnamed op or a
    barrier does so): only the bits that changed go stale, so the armed op stays in the
    lane (before, every cache change sent every slot back through Python).  A new shape
    for the armed name itself evicts its bit: that run falls back, and re-arms."""
    comm = collectives.init()
    eng = FusionEngine(comm, lane=True)
    r, size = comm.rank, comm.size
    codes, bad = [], []
    for step in range(steps):
        n = 64 if step != steps // 2 else 65  # one step with a new shape under the same name
        got, code = lane_allreduce(eng, 0 if n == 64 else 1, "g", data(r, step, n, np.float32))
        codes.append(code)
        if not np.array_equal(got, expected(size, step, n, np.float32, ReduceOp.AVERAGE, 1.0)):
            bad.append(step)
        eng.submit(f"new.{step}", "allreduce", np.ones(3), op=ReduceOp.SUM, lazy=True).wait(WAIT)
    eng.shutdown()
    comm.close()
    return {"codes": codes, "bad": bad}
