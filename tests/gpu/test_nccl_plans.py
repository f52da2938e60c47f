"""The NCCL calls each rank plans, executed by an NCCL-semantics interpreter on numpy.

The interpreter pairs the ranks' plans call by call, as NCCL does, and gives
each call NCCL's documented meaning (a broadcast copies root's send buffer
into every rank's receive buffer; a reduce sums into the root's; a send
matches the peer's recv).  Any offset or pairing mistake in a plan shows up
as a wrong result against numpy.  No GPU is involved.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from collectives.backends._nccl_plan import (check_counts, offsets, plan_allgather, plan_alltoall,
                                             plan_reducescatter)


def _execute(plans: list, srcs: list, dsts: list) -> None:
    """Run every rank's plan, one collective call (or send/recv exchange) at a time."""
    n = len(plans)
    for r in range(n):  # local copies first: they touch no peer
        for c in plans[r]:
            if c.kind == "copy":
                dsts[r][c.dst_off:c.dst_off + c.count] = srcs[r][c.src_off:c.src_off + c.count]
    colls = [[c for c in p if c.kind not in ("copy", "send", "recv")] for p in plans]
    assert len({len(c) for c in colls}) == 1, f"ranks plan different numbers of collectives: {colls}"
    for step in zip(*colls):
        assert len({(c.kind, c.count, c.peer) for c in step}) == 1, f"unpaired calls {step}"
        _collective(step, srcs, dsts)
    sends = {(r, c.peer): c for r in range(n) for c in plans[r] if c.kind == "send"}
    recvs = {(c.peer, r): c for r in range(n) for c in plans[r] if c.kind == "recv"}
    assert sends.keys() == recvs.keys(), f"sends {sorted(sends)} vs recvs {sorted(recvs)}"
    for (i, j), s in sends.items():
        rv = recvs[(i, j)]
        assert s.count == rv.count, f"rank {i} sends {s.count} to {j}, which expects {rv.count}"
        dsts[j][rv.dst_off:rv.dst_off + rv.count] = srcs[i][s.src_off:s.src_off + s.count]


def _collective(step, srcs, dsts) -> None:
    c0, n = step[0], len(step)

    def read(r, c):
        buf = dsts[r] if c.src_buf == "dst" else srcs[r]
        return buf[c.src_off:c.src_off + c.count].copy()

    if c0.kind == "allgather":
        for r in range(n):
            dsts[r][:] = np.concatenate([read(q, step[q]) for q in range(n)])
    elif c0.kind == "broadcast":
        data = read(c0.peer, step[c0.peer])
        for r, c in enumerate(step):
            dsts[r][c.dst_off:c.dst_off + c.count] = data
    elif c0.kind == "reducescatter":
        total = sum(srcs[r][:c0.count * n] for r in range(n))
        for r in range(n):
            dsts[r][:c0.count] = total[r * c0.count:(r + 1) * c0.count]
    elif c0.kind == "reduce":
        total = sum(read(r, c) for r, c in enumerate(step))
        root = step[c0.peer]
        dsts[c0.peer][root.dst_off:root.dst_off + root.count] = total
    else:
        raise AssertionError(c0.kind)


def _inputs(counts_per_rank: list) -> list:
    return [np.arange(c, dtype=np.int64) + 1000 * (r + 1) for r, c in enumerate(counts_per_rank)]


COUNT_SETS = [[0], [5], [3, 3], [0, 4], [2, 0, 7], [1, 1, 1], [0, 0, 0], [4, 1, 0, 9]]


@pytest.mark.parametrize("counts", COUNT_SETS, ids=str)
def test_allgather_plans_concatenate_every_ranks_block(counts):
    n = len(counts)
    srcs = _inputs(counts)
    dsts = [np.full(sum(counts), -1, np.int64) for _ in range(n)]
    _execute([plan_allgather(counts, r) for r in range(n)], srcs, dsts)
    for d in dsts:
        assert np.array_equal(d, np.concatenate(srcs))


@pytest.mark.parametrize("counts", COUNT_SETS, ids=str)
def test_reducescatter_plans_give_each_rank_its_reduced_block(counts):
    n = len(counts)
    srcs = _inputs([sum(counts)] * n)
    dsts = [np.full(counts[r], -1, np.int64) for r in range(n)]
    _execute([plan_reducescatter(counts, r) for r in range(n)], srcs, dsts)
    total, lo = sum(srcs), offsets(counts)
    for r in range(n):
        assert np.array_equal(dsts[r], total[lo[r]:lo[r] + counts[r]])


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_alltoall_plans_deliver_block_j_of_rank_i_to_rank_j(n):
    split = {(i, j): (i + 2 * j) % 3 for i, j in itertools.product(range(n), repeat=2)}
    send = [[split[(i, j)] for j in range(n)] for i in range(n)]
    recv = [[split[(j, i)] for j in range(n)] for i in range(n)]
    srcs = _inputs([sum(s) for s in send])
    dsts = [np.full(sum(r), -1, np.int64) for r in recv]
    _execute([plan_alltoall(send[r], recv[r], r) for r in range(n)], srcs, dsts)
    for j in range(n):
        want = [srcs[i][offsets(send[i])[j]:offsets(send[i])[j] + split[(i, j)]] for i in range(n)]
        assert np.array_equal(dsts[j], np.concatenate(want))


def test_equal_counts_use_one_native_call_and_empty_blocks_issue_none():
    assert [c.kind for c in plan_allgather([4, 4, 4], 1)] == ["allgather"]
    assert [c.kind for c in plan_reducescatter([2, 2], 0)] == ["reducescatter"]
    assert plan_allgather([0, 0], 0) == [] and plan_reducescatter([0, 0, 0], 2) == []
    assert [c.peer for c in plan_allgather([3, 0, 2], 1)] == [0, 2]


def test_alltoall_refuses_a_self_block_of_two_sizes():
    with pytest.raises(ValueError, match="rank 1 sends 2 elements to itself but expects 3"):
        plan_alltoall([1, 2], [1, 3], 1)


def test_counts_that_do_not_match_the_buffers_are_refused_at_the_call():
    with pytest.raises(ValueError, match=r"input of 3 and output of 9 elements do not match counts \[4, 5\]"):
        check_counts("allgather", 3, 9, [4, 5], 0, mine_is="input")
    with pytest.raises(ValueError, match="one non-negative number per rank"):
        check_counts("reducescatter", 0, 0, [1, -1], 0, mine_is="output")
