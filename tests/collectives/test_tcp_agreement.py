"""Ranks that disagree on a collective over TCP: every rank gets a MismatchError naming the ops.

A case is what each rank calls: one rank (the odd one) calls another op, or
the same op with another count or dtype, than the others.  Over TCP every op
starts with a header naming it (native/src/tcp/header.h), so each rank must
fail with a MismatchError that names both ops and a peer with its address,
within the op timeout, never with a lost connection, a timeout or a result.
One group of rank processes runs every case of a world size, each on a fresh
communicator (a broken one refuses every later op).
"""
from __future__ import annotations

import pytest

from collectives.launch import run_local

TCP = {"HOROVOD_SPARK_FORCE_TCP": "1", "HOROVOD_SPARK_TIMEOUT": "20"}

# name: (what the odd rank calls, what the others call, texts every error names)
CASES = {
    "count": (("allreduce", 10, "float32"), ("allreduce", 12, "float32"),
              ("allreduce sum of 10 float32", "allreduce sum of 12 float32")),
    "dtype": (("allreduce", 1024, "int32"), ("allreduce", 1024, "float32"),
              ("allreduce sum of 1024 int32", "allreduce sum of 1024 float32")),
    "count and dtype": (("allreduce", 15, "int32"), ("allreduce", 1024, "float32"),
                        ("allreduce sum of 15 int32", "allreduce sum of 1024 float32")),
    "broadcast among allreduces": (("broadcast", 64, "float32"), ("allreduce", 64, "float32"),
                                   ("broadcast of 64 float32 from rank 0", "allreduce sum of 64 float32")),
    "allreduce among broadcasts": (("allreduce", 64, "float32"), ("broadcast", 64, "float32"),
                                   ("allreduce sum of 64 float32", "broadcast of 64 float32 from rank 0")),
    "barrier among allgathers": (("barrier", 0, "float32"), ("allgather", 8, "float32"),
                                 ("barrier", "allgather of")),
    "empty allreduce among full ones": (("allreduce", 0, "float32"), ("allreduce", 5, "float32"),
                                        ("allreduce sum of 0 float32", "allreduce sum of 5 float32")),
    "alltoall among allreduces": (("alltoall", 6, "float32"), ("allreduce", 6, "float32"),
                                  ("alltoall", "allreduce sum of 6 float32")),
}


def _call(comm, what, count, dtype):
    import numpy as np

    x = np.ones(count, dtype)
    if what == "allreduce":
        comm.allreduce(x)
    elif what == "broadcast":
        comm.broadcast(x, root=0)
    elif what == "allgather":
        comm.allgather(x)
    elif what == "alltoall":
        comm.alltoall(x)
    else:
        comm.barrier()


def _every_case(cases):
    """Runs each (name, odd rank) on a fresh communicator; returns what each raised."""
    import collectives

    out = {}
    for name, odd in cases:
        comm = collectives.init()
        mine, others, _ = CASES[name]
        try:
            _call(comm, *(mine if comm.rank == odd else others))
            out[f"{name}@{odd}"] = {"error": None}
        except collectives.CollectiveError as exc:
            out[f"{name}@{odd}"] = {"error": type(exc).__name__, "message": str(exc)}
        finally:
            comm.close()
    return out


def _check(reports, cases):
    for name, odd in cases:
        for rank, rep in enumerate(reports):
            got = rep[f"{name}@{odd}"]
            where = f"{name}, odd rank {odd}, rank {rank}: {got}"
            assert got["error"] == "MismatchError", where
            assert "ranks disagree" in got["message"] and f"on rank {rank}/" in got["message"], where
            assert all(text in got["message"] for text in CASES[name][2]), where
            assert "(peer rank " in got["message"] and " at 127.0.0.1:" in got["message"], where


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3])
def test_over_tcp_every_rank_names_both_ops_when_one_rank_disagrees(size):
    odd_ranks = (0, size - 1) if size == 2 else (0, 1, 2)
    cases = [(name, odd) for name in CASES for odd in odd_ranks]
    reports = run_local(_every_case, size, args=(cases,), env=TCP, timeout=110)
    _check(reports, cases)


@pytest.mark.timeout(120)
def test_over_tcp_a_rank_two_hops_from_the_disagreement_is_told_too():
    # 4 ranks in a ring: rank 2 exchanges nothing with rank 0 in an allreduce.
    cases = [("count", 0), ("broadcast among allreduces", 0), ("allreduce among broadcasts", 2)]
    reports = run_local(_every_case, 4, args=(cases,), env=TCP, timeout=110)
    _check(reports, cases)


def _alltoall_splits_disagree():
    """Rank 1 sends 3 elements to rank 0, which expects 2 (the backend call
    takes both sides' counts: the Communicator exchanges splits first)."""
    import numpy as np

    import collectives
    from collectives.types import DType

    comm = collectives.init()
    send, recv = [2] * comm.size, [2] * comm.size
    if comm.rank == 1:
        send[0] = 3
    out = {}
    for step in ("alltoall", "then a barrier"):
        try:
            if step == "alltoall":
                comm.backend.alltoall(np.ones(sum(send), np.float32), send,
                                      np.empty(sum(recv), np.float32), recv, DType.FLOAT32)
            else:
                comm.backend.barrier()
        except collectives.CollectiveError as exc:
            out[step] = f"{type(exc).__name__}: {exc}"
            break
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3])
def test_over_tcp_alltoall_counts_that_disagree_fail_both_ends_and_a_bystander_at_its_next_op(size):
    reports = run_local(_alltoall_splits_disagree, size, env=TCP, timeout=60)
    for rank in (0, 1):  # each end checks both directions of its pair, or hears from the other
        got = reports[rank].get("alltoall", "")
        assert got.startswith("MismatchError") and "ranks disagree" in got, (rank, reports)
        assert "this rank is in alltoall" in got and "the peer in alltoall" in got, (rank, reports)
        assert "sending 3" in got and "expecting 2" in got, (rank, reports)
    for rank in range(2, size):  # its pairs agreed: it may finish, then its next op fails
        got = list(reports[rank].values())
        assert len(got) == 1 and got[0].startswith("MismatchError"), (rank, reports)
        assert "rank 0" in got[0] and "rank 1" in got[0] and "alltoall" in got[0], (rank, reports)


def _disagree_across_hosts(odd, how):
    import numpy as np

    import collectives

    comm = collectives.init()
    try:
        if how == "count":
            comm.allreduce(np.ones(10 if comm.rank == odd else 12, np.float32))
        else:
            x = np.ones(64, np.float32)
            comm.broadcast(x, root=0) if comm.rank == odd else comm.allreduce(x)
    except collectives.CollectiveError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("odd,how", [(3, "count"), (2, "count"), (1, "op")],
                         ids=["a non-leader's count", "a leader's count", "a non-leader's op"])
def test_across_two_fake_hosts_every_rank_gets_the_mismatch(odd, how):
    env = {"HOROVOD_SPARK_TIMEOUT": "20"}
    reports = run_local(_disagree_across_hosts, 4, args=(odd, how), env=env,
                        hosts=["a", "a", "b", "b"], timeout=60)
    for rank, rep in enumerate(reports):
        assert rep["error"] == "MismatchError", (rank, rep)
        assert "disagree" in rep["message"], (rank, rep)
