"""Every op x dtype x count of the shared suite against numpy, with real rank
processes: through shared memory (staged through the segment, and by
cross-memory attach with thresholds so low that every allreduce takes it), over
forced TCP, and across two fake hosts (shared memory within each, TCP between
their leaders).  One group of rank processes per world size and path: starting
ranks is what costs time."""
import os

import pytest

from collectives.launch import run_local

HERE = os.path.dirname(os.path.abspath(__file__))
TCP = {"HOROVOD_SPARK_FORCE_TCP": "1"}


#: cross-memory attach for every allreduce, in chunks small enough that the suite's
#: large counts take several, and some ranks' slices of a small count are empty
CMA_EVERYWHERE = {"cma_bytes": 1, "cma_chunk": 64 * 1024 + 64}
STAGED = {"cma_bytes": 0}


def _run_suite(here, tuning=None):
    import sys

    import collectives
    from collectives.backends import native

    sys.path.insert(0, here)
    from suite import check_all

    native.TUNING.update(tuning or {})
    comm = collectives.init()
    try:
        checks = check_all(comm)
        return dict(backend=comm.backend_name, local_size=comm.local_size,
                    cross_size=comm.cross_size, checks=checks, cma=comm.backend.cma)
    finally:
        comm.close()


def _suite_on(size, env=None, hosts=None, tuning=None):
    return run_local(_run_suite, size, args=(HERE, tuning), env=env, hosts=hosts, timeout=240)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("tuning", [STAGED, CMA_EVERYWHERE], ids=["staged", "cma"])
def test_every_op_matches_numpy_through_shared_memory(size, tuning):
    if size == 1 and tuning is CMA_EVERYWHERE:
        pytest.skip("one rank moves nothing")
    results = _suite_on(size, tuning=tuning)
    assert all(r["backend"] == "native" and r["local_size"] == size for r in results)
    if tuning is CMA_EVERYWHERE:
        if results[0]["cma"] == "off":
            pytest.skip("this kernel refuses process_vm_readv between the ranks (Yama "
                        "ptrace_scope or seccomp): the staged path ran, and passed")
        assert [r["cma"] for r in results] == ["on"] * size


@pytest.mark.parametrize("size", [2, 3, 4])
def test_every_op_matches_numpy_over_forced_tcp(size):
    results = _suite_on(size, env=TCP)
    assert all(r["local_size"] == 1 and r["cross_size"] == size for r in results)


@pytest.mark.parametrize("hosts", [("a", "a", "b", "b"), ("a", "b", "a")], ids=["aabb", "aba"])
def test_every_op_matches_numpy_across_two_fake_hosts(hosts):
    results = _suite_on(len(hosts), hosts=list(hosts))
    assert [r["cross_size"] for r in results] == [2] * len(hosts)
    assert [r["local_size"] for r in results] == [hosts.count(h) for h in hosts]


def _agree_on_cma(refuse: int, cma_bytes: dict):
    import numpy as np

    import collectives
    from collectives import MismatchError
    from collectives.backends import native

    rank = int(__import__("os").environ["HVS_RANK"])
    native.TUNING.update(cma_bytes=cma_bytes.get(rank, 1), cma_chunk=4096)
    comm = collectives.init(collectives.Config.create({"shm_cma": rank != refuse}))
    try:
        x = np.arange(10_000, dtype=np.float64) * (rank + 1)
        got = comm.allreduce(x)
        ok = np.array_equal(got, np.arange(10_000) * sum(range(1, comm.size + 1)))
        return {"ok": ok, "cma": comm.backend.cma}
    except MismatchError as exc:
        return {"mismatch": str(exc)}
    finally:
        comm.close()


def test_one_rank_that_refuses_cross_memory_attach_makes_every_rank_stage():
    results = run_local(_agree_on_cma, 3, args=(1, {}), timeout=120)
    assert results == [{"ok": True, "cma": "off"}] * 3


def test_ranks_that_would_take_different_algorithms_fail_with_a_mismatch():
    results = run_local(_agree_on_cma, 2, args=(-1, {0: 1, 1: 0}), timeout=120)
    for r in results:
        assert "mismatch" in r and "disagree" in r["mismatch"], results
