"""Ranks on separate hosts of a Spark standalone cluster: placement, exact results.

Two apps serve this module's jobs: `pair`, two executors of 2 cores on two
hosts, and `trio`, three executors of 2 cores, one on each worker host.
"""
import json
import os
import subprocess
import sys
import threading
import time

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(900)]

HOSTILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_hostile.py")


@pytest.fixture(scope="module")
def pair(cluster):
    app = cluster.app("pair", cores=4, executor_cores=2)
    yield app
    app.close()


@pytest.fixture(scope="module")
def trio(cluster):
    app = cluster.app("trio", cores=6, executor_cores=2)
    yield app
    app.close()


@pytest.fixture(scope="module")
def four_on_two(pair):
    result = pair.run("collectives", np=4, modes=["driver", "spark"])
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


@pytest.mark.parametrize("backend", ["gloo", "hvs"])  # hvs: shared memory in a host, TCP across
def test_a_ddp_function_runs_on_four_ranks_on_two_hosts_through_torch_distributor(pair, cluster,
                                                                                  backend):
    import numpy as np

    result = pair.run("torchdist", np=4, backend=backend)
    assert "exception" not in result, result.get("exception")
    ranks = result["ranks"]
    assert [r["env"]["RANK"] for r in ranks] == ["0", "1", "2", "3"]
    assert {r["env"]["MASTER_ADDR"] for r in ranks} == {ranks[0]["env"]["HVS_BIND_ADDR"]}
    assert len({r["env"]["HVS_BIND_ADDR"] for r in ranks}) == 2  # two hosts
    assert [r["env"]["GROUP_RANK"] for r in ranks] == ["0", "1", "2", "3"]  # a node a task
    for r in ranks:
        for got, want in zip(r["weights"], result["expected"]):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def six_on_three(trio):
    result = trio.run("collectives", np=6, modes=["driver"])
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
    first rank (its group's leader) sends over TCP; the allreduces of 8 MiB and more
    were pipelined where the host's ranks read each other by cross-memory attach."""
    ranks, _ = six_on_three
    for r in ranks:
        m = r["metrics"]
        assert m["shm_ops"] > 0 and m["shm_bytes"] > 0, (r["rank"], m)
        assert (m["pipelined_ops"] > 0) == (r["cma"] == "on"), (r["rank"], r["cma"], m)
        if r["local_rank"] == 0:
            assert m["tcp_bytes_sent"] > 0 and m["tcp_ops"] > 0, (r["rank"], m)
        else:
            assert m["tcp_bytes_sent"] == 0 and m["tcp_ops"] == 0, (r["rank"], m)


def test_placement_two_one_one_trains_with_the_default_optimizer(trio):
    """4 ranks on three executors of 2 cores: Spark hands a stage's tasks to its executors
    in turn, so 2 ranks land on one host and 1 on each of the two others (placement
    2+1+1); with the default DistributedOptimizer: done, identical weights."""
    result = trio.run("collectives", np=4, modes=["driver"])
    print(f"placement 2+1+1: seconds {result['seconds']}")
    ranks = result["runs"]["driver"]
    assert sorted(r["local_size"] for r in ranks) == [1, 1, 2, 2]
    assert len({r["weights"] for r in ranks}) == 1
    for r in ranks:
        assert r["sums"] == result["expected"], f"rank {r['rank']}"


def _wait(what, predicate, seconds):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"{what} within {seconds} s"
        time.sleep(0.2)


def _address(key):
    addr, port = key.rsplit(":", 1)
    return addr, int(port)


class _Scanner(threading.Thread):
    """Hands every new listener of a Python process on the hosts to the attacker."""

    def __init__(self, hosts, attacker):
        super().__init__(daemon=True)
        self.hosts, self.attacker = hosts, attacker
        self.seen, self.halt = {}, threading.Event()

    def run(self):
        while not self.halt.is_set():
            for host in self.hosts:
                for addr, port in host.listeners(b"python"):
                    if (addr, port) not in self.seen:
                        self.seen[(addr, port)] = host.name
                        self.attacker.stdin.write(f"{addr} {port}\n".encode())
                        self.attacker.stdin.flush()
            self.halt.wait(0.2)


def test_a_hostile_host_on_every_listener_changes_no_result(cluster, pair):
    """A host of its own connects to every listener of a running job (the driver's log
    server, the task stores, the ranks' mesh listeners while they stand) with garbage, a
    wrong secret, a half handshake and idle connections held open: the job's sums stay
    exact, it runs on after the attack and ends when asked, not at a timeout."""
    hostile = next((h for h in cluster.netns.hosts if h.name == "x"), None)
    hostile = hostile or cluster.netns.add_host("x")
    work = cluster.scratch("hostile")
    markers, attacked, stop = (os.path.join(work, n) for n in ("markers", "attacked", "stop"))
    os.makedirs(markers)
    log = os.path.join(work, "attacker.log")
    attacker = hostile.box.spawn([sys.executable, HOSTILE], cluster.spark.env, log,
                                 stdin=subprocess.PIPE)
    scanner = _Scanner([cluster.head] + cluster.workers, attacker)
    scanner.start()
    try:
        pair.start("steady", np=4, markers=markers, attacked=attacked, stop=stop, seconds=300,
                   env={"HOROVOD_SPARK_TIMEOUT": "20"})
        _wait("the ranks start", lambda: len(os.listdir(markers)) == 4, 300)
        job_hosts = {json.load(open(os.path.join(markers, n)))["host"] for n in os.listdir(markers)}
        names = {h.address: h.name for h in cluster.workers}
        _wait("the attacker reaches the driver and both hosts", lambda: {
            cluster.head.name, *(names[a] for a in job_hosts)} <= set(scanner.seen.values()), 30)
        time.sleep(2)  # the attacks run; the idle connections stay open
        open(attacked, "w").close()
        time.sleep(3)
        open(stop, "w").close()
        result = pair.result(timeout=120)
    finally:
        scanner.halt.set()
        scanner.join(timeout=30)
        attacker.stdin.close()
        attacker.wait(timeout=60)
    with open(log) as f:
        report = next(json.loads(ln[len("REPORT "):]) for ln in f if ln.startswith("REPORT "))
    print(f"hostile host: {len(report)} listeners attacked: {report}; job {result['seconds']:.1f} s")
    ours = {k: v for k, v in report.items() if v.get("ours")}
    assert {scanner.seen[_address(k)] for k in ours} >= {cluster.head.name,
                                                        *(names[a] for a in job_hosts)}, report
    assert all(v["wrong_secret"] != "answered" for v in ours.values()), report
    for r in result["ranks"]:
        assert r["wrong"] == 0 and r["stopped"] and r["after"] > 0, r
