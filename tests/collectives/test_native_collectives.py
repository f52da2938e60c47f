"""Every op x dtype x count of the shared suite against numpy, with real rank
processes: through shared memory, over forced TCP, and across two fake hosts
(shared memory within each, TCP between their leaders).  One group of rank
processes per world size and path: starting ranks is what costs time."""
import os

import pytest

from collectives.launch import run_local

HERE = os.path.dirname(os.path.abspath(__file__))
TCP = {"HOROVOD_SPARK_FORCE_TCP": "1"}


def _run_suite(here):
    import sys

    import collectives

    sys.path.insert(0, here)
    from suite import check_all

    comm = collectives.init()
    try:
        checks = check_all(comm)
        return dict(backend=comm.backend_name, local_size=comm.local_size,
                    cross_size=comm.cross_size, checks=checks)
    finally:
        comm.close()


def _suite_on(size, env=None, hosts=None):
    return run_local(_run_suite, size, args=(HERE,), env=env, hosts=hosts, timeout=240)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_every_op_matches_numpy_through_shared_memory(size):
    results = _suite_on(size)
    assert all(r["backend"] == "native" and r["local_size"] == size for r in results)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_every_op_matches_numpy_over_forced_tcp(size):
    results = _suite_on(size, env=TCP)
    assert all(r["local_size"] == 1 and r["cross_size"] == size for r in results)


@pytest.mark.parametrize("hosts", [("a", "a", "b", "b"), ("a", "b", "a")], ids=["aabb", "aba"])
def test_every_op_matches_numpy_across_two_fake_hosts(hosts):
    results = _suite_on(len(hosts), hosts=list(hosts))
    assert [r["cross_size"] for r in results] == [2] * len(hosts)
    assert [r["local_size"] for r in results] == [hosts.count(h) for h in hosts]
