"""Every op x dtype x count of the shared suite against numpy, with real rank
processes: through shared memory (staged through the segment, and by
cross-memory attach with thresholds so low that every allreduce takes it), over
forced TCP, and across two fake hosts (shared memory within each, TCP between
their leaders).  One group of rank processes per world size and path: starting
ranks is what costs time."""
import os
import time

import pytest

from collectives.launch import run_local

HERE = os.path.dirname(os.path.abspath(__file__))
TCP = {"HOROVOD_SPARK_FORCE_TCP": "1"}


#: cross-memory attach for every allreduce, in chunks small enough that the suite's
#: large counts take several, and some ranks' slices of a small count are empty; across
#: hosts the large counts are pipelined, several chunks a buffer, the last one short
CMA_EVERYWHERE = {"cma_bytes": 1, "cma_chunk": 64 * 1024 + 64, "hier_chunk": 48 * 1024 + 8}
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
                    cross_size=comm.cross_size, checks=checks, cma=comm.backend.cma,
                    pipelined=comm.backend.transport_metrics()["pipelined_ops"])
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


@pytest.mark.parametrize("size", [2, 3, 4, 7])  # 7: recursive doubling's three fold ranks
def test_every_op_matches_numpy_over_forced_tcp(size):
    results = _suite_on(size, env=TCP)
    assert all(r["local_size"] == 1 and r["cross_size"] == size for r in results)


@pytest.mark.parametrize("tuning", [None, CMA_EVERYWHERE], ids=["default", "cma"])
@pytest.mark.parametrize("hosts", [("a", "a", "b", "b"), ("a", "b", "a")], ids=["aabb", "aba"])
def test_every_op_matches_numpy_across_two_fake_hosts(hosts, tuning):
    results = _suite_on(len(hosts), hosts=list(hosts), tuning=tuning)
    assert [r["cross_size"] for r in results] == [2] * len(hosts)
    assert [r["local_size"] for r in results] == [hosts.count(h) for h in hosts]
    # the large allreduces of a group that reads by cross-memory attach were pipelined
    # (the default hier_chunk pipelines none of the suite's sizes)
    for r in results:
        if tuning and r["local_size"] > 1 and r["cma"] == "on":
            assert r["pipelined"] > 0, results
        else:
            assert r["pipelined"] == 0, results


def _agree_on_cma(refuse: int, cma_bytes: dict, hier_chunks=None):
    import numpy as np

    import collectives
    from collectives import MismatchError
    from collectives.backends import native

    rank = int(__import__("os").environ["HVS_RANK"])
    native.TUNING.update(cma_bytes=cma_bytes.get(rank, 1), cma_chunk=4096,
                         hier_chunk=(hier_chunks or {}).get(rank, 8192))
    comm = collectives.init(collectives.Config.create({"shm_cma": rank != refuse}))
    try:
        x = np.arange(10_000, dtype=np.float64) * (rank + 1)
        got = comm.allreduce(x)
        ok = np.array_equal(got, np.arange(10_000) * sum(range(1, comm.size + 1)))
        return {"ok": ok, "cma": comm.backend.cma,
                "pipelined": comm.backend.transport_metrics()["pipelined_ops"]}
    except MismatchError as exc:
        return {"mismatch": str(exc)}
    finally:
        comm.close()


def test_one_rank_that_refuses_cross_memory_attach_makes_every_rank_stage():
    results = run_local(_agree_on_cma, 3, args=(1, {}), timeout=120)
    assert results == [{"ok": True, "cma": "off", "pipelined": 0}] * 3


def test_hosts_that_differ_on_cross_memory_attach_still_sum_exactly():
    """Host a's ranks stage through their segment (rank 0 refuses cross-memory attach),
    host b's read each other's buffers: a choice within a host, nothing on the wire.
    The buffer is ten hier_chunks: b's leader runs its rings on a thread, overlapped
    with its group's phases, a's one after another, and they pair."""
    results = run_local(_agree_on_cma, 4, args=(0, {}), hosts=["a", "a", "b", "b"], timeout=120)
    assert results == [{"ok": True, "cma": c, "pipelined": int(c == "on")}
                       for c in ("off", "off", "on", "on")], results


def test_ranks_that_would_take_different_algorithms_fail_with_a_mismatch():
    results = run_local(_agree_on_cma, 2, args=(-1, {0: 1, 1: 0}), timeout=120)
    for r in results:
        assert "mismatch" in r and "disagree" in r["mismatch"], results


@pytest.mark.parametrize("odd", [1, 2], ids=["a-reader", "a-leader"])
def test_ranks_that_would_cut_the_leaders_ring_differently_fail_with_a_mismatch(odd):
    """A rank whose hier_chunk differs would pair other rings: every rank fails at once,
    the ranks that found it saying both chunkings."""
    results = run_local(_agree_on_cma, 4, args=(-1, {}, {odd: 4096}), hosts=["a", "a", "b", "b"],
                        timeout=120)
    assert all("mismatch" in r for r in results), results
    assert any("chunks of 512 elements" in r["mismatch"] and "chunks of 1024 elements"
               in r["mismatch"] for r in results), results


def _pinned(core: int, conn) -> None:
    os.sched_setaffinity(0, {core})
    conn.recv()  # stay alive (and pinned) until the test has read this process's mask


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux affinity masks and two usable cores")
def test_ranks_pinned_to_a_core_each_count_every_core_of_the_host_not_one():
    # Each rank's own mask says one core; the host's ranks together have two, so two
    # ranks are not crowded (they spin, then yield, before they sleep).
    import multiprocessing as mp

    from collectives.backends.base import Topology
    from collectives.backends.native import host_cores

    cores = sorted(os.sched_getaffinity(0))[:2]
    ctx = mp.get_context("spawn")
    ends = [ctx.Pipe() for _ in cores]
    procs = [ctx.Process(target=_pinned, args=(c, child)) for c, (_, child) in zip(cores, ends)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 60
        while any(os.sched_getaffinity(p.pid) != {c} for p, c in zip(procs, cores)):
            assert time.monotonic() < deadline, "the children never pinned themselves"
            time.sleep(0.05)
        topo = Topology(rank=0, size=3, hosts=("h", "h", "elsewhere"))
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {cores[0]})  # this process stands for rank 0, pinned too
        try:
            assert host_cores(topo, [os.getpid(), procs[1].pid, procs[0].pid]) == 2
            # a peer whose mask can't be read (gone, or another pid namespace): own mask
            assert host_cores(topo, [os.getpid(), 2 ** 22 + 12345, procs[0].pid]) == 1
        finally:
            os.sched_setaffinity(0, before)
    finally:
        for parent, _ in ends:
            parent.send(None)
        for p in procs:
            p.join(30)
