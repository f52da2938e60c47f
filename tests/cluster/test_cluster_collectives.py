"""Ranks on separate hosts of a Spark standalone cluster: placement, exact results."""
import json
import os

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(900)]

PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_program.py")


def _run(cluster, np_, env=None, modes=("driver", "spark"), executor_cores=2):
    return cluster.spark.run_driver(PROGRAM, ["collectives", json.dumps(
        {"np": np_, "executor_cores": executor_cores, "env": env or {}, "modes": list(modes)})])


@pytest.fixture(scope="module")
def four_on_two(cluster):
    result = _run(cluster, 4)
    print(f"4 ranks on 2 hosts: seconds {result['seconds']}")
    return result


@pytest.mark.parametrize("mode", ["driver", "spark"])
def test_four_ranks_on_two_hosts_have_horovod_placement(four_on_two, cluster, mode):
    ranks = four_on_two["runs"][mode]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    by_host = {}
    for r in ranks:
        by_host.setdefault(r["addr"], []).append(r)
    assert len(by_host) == 2, by_host.keys()
    workers = {h.address: h.name for h in cluster.workers}
    for addr, group in by_host.items():
        assert {r["hostname"] for r in group} == {workers[addr]}
        assert sorted(r["local_rank"] for r in group) == [0, 1]
        assert {r["local_size"] for r in group} == {2}
        assert {r["cross_size"] for r in group} == {2}
    assert sorted({r["cross_rank"] for r in ranks}) == [0, 1]


@pytest.mark.parametrize("mode", ["driver", "spark"])
def test_four_ranks_on_two_hosts_sum_exactly_and_agree_on_weights(four_on_two, mode):
    ranks = four_on_two["runs"][mode]
    for r in ranks:
        assert r["sums"] == four_on_two["expected"], f"rank {r['rank']}"
    assert len({r["weights"] for r in ranks}) == 1


@pytest.fixture(scope="module")
def six_on_three(cluster):
    result = _run(cluster, 6, modes=["driver"])
    print(f"6 ranks on 3 hosts: seconds {result['seconds']}")
    return result["runs"]["driver"], result["expected"]


def test_six_ranks_on_three_hosts_sum_exactly_and_agree_on_weights(six_on_three):
    ranks, expected = six_on_three
    assert len({r["addr"] for r in ranks}) == 3
    assert {(r["local_size"], r["cross_size"]) for r in ranks} == {(2, 3)}
    for r in ranks:
        assert r["sums"] == expected, f"rank {r['rank']}"
    assert len({r["weights"] for r in ranks}) == 1


def test_shared_memory_carries_a_host_and_tcp_joins_the_hosts(six_on_three):
    """The transport counters: every rank uses its host's segment; only each host's
    first rank (its group's leader) sends over TCP."""
    ranks, _ = six_on_three
    for r in ranks:
        m = r["metrics"]
        assert m["shm_ops"] > 0 and m["shm_bytes"] > 0, (r["rank"], m)
        if r["local_rank"] == 0:
            assert m["tcp_bytes_sent"] > 0 and m["tcp_ops"] > 0, (r["rank"], m)
        else:
            assert m["tcp_bytes_sent"] == 0 and m["tcp_ops"] == 0, (r["rank"], m)


def test_placement_two_one_one_trains_with_the_default_optimizer(cluster):
    """Executors of one core each: 2 ranks on one host, 1 on two others (placement
    2+1+1), with the default DistributedOptimizer: done, identical weights."""
    result = _run(cluster, 4, modes=["driver"], executor_cores=1)
    print(f"placement 2+1+1: seconds {result['seconds']}")
    ranks = result["runs"]["driver"]
    assert sorted(r["local_size"] for r in ranks) == [1, 1, 2, 2]
    assert len({r["weights"] for r in ranks}) == 1
    for r in ranks:
        assert r["sums"] == result["expected"], f"rank {r['rank']}"
