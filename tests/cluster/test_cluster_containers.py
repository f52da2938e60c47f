"""Two executors with one address but separate /dev/shm (containers with host networking).

A host 'c' of two boxes (one network namespace, two mount namespaces), one
Worker in each, offering more memory than the other Workers so that only they
fit this module's executors.  The two ranks are one host for Horovod
(local_size 2) but cannot share a segment: they meet over TCP, at once, with
exact results, instead of waiting for a segment that cannot appear.
"""
import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(900)]

MEMORY = "3500m"  # more than the other Workers offer


@pytest.fixture(scope="module")
def containers(cluster):
    host = next((h for h in cluster.netns.hosts if h.name == "c"), None)
    host = host or cluster.netns.add_host("c", boxes=2)
    cluster.spark.add_workers(host.boxes, cores=1, memory="4g")
    try:
        yield host
    finally:
        for box in host.boxes:
            cluster.spark.stop_worker(box)


def test_ranks_on_one_address_without_a_common_dev_shm_meet_over_tcp(cluster, containers):
    app = cluster.app("containers", cores=2, executor_cores=1,
                      conf=[("spark.executor.memory", MEMORY)])
    try:
        result = app.run("collectives", np=2, modes=["driver"], steps=2,
                         env={"HOROVOD_SPARK_CONNECT_TIMEOUT": "30"})
    finally:
        app.close()
    ranks = result["runs"]["driver"]
    assert {r["addr"] for r in ranks} == {containers.address}
    assert sorted(r["hostname"] for r in ranks) == ["c", "c-b"]
    assert [(r["local_rank"], r["local_size"], r["cross_size"]) for r in ranks] == [(0, 2, 1),
                                                                                    (1, 2, 1)]
    for r in ranks:
        assert r["sums"] == result["expected"], f"rank {r['rank']}"
        assert r["metrics"]["shm_ops"] == 0 and r["metrics"]["tcp_ops"] > 0, r["metrics"]
    assert len({r["weights"] for r in ranks}) == 1
