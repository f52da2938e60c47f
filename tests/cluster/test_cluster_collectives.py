"""Ranks on separate hosts of a Spark standalone cluster: placement, exact results."""
import os

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.spark, pytest.mark.slow]

PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_program.py")


def _run(cluster, np_, env=None):
    import json

    return cluster.spark.run_driver(PROGRAM, ["collectives", json.dumps(
        {"np": np_, "executor_cores": 2, "env": env or {}})])


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
