"""Faults on the emulated cluster: a killed rank, executor JVM or Worker JVM, a cut link.

Each test starts a job of 4 ranks on 2 hosts that allreduces until it is
broken from outside, breaks it, and reads the driver's error: it names the
culprit (rank, host, cause) within the op timeout, and afterwards no rank
process, zygote or /dev/shm entry is left on any host.  One app serves the
module's jobs; its jobs only fail, so it never keeps a warm zygote, and any
zygote found is a leftover.
"""
import json
import os
import signal
import time

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(900)]

OP_TIMEOUT = 20  # HOROVOD_SPARK_TIMEOUT of these jobs: the bound on noticing a loss


@pytest.fixture(scope="module")
def app(cluster):
    app = cluster.app("faults", cores=4, executor_cores=2)
    yield app
    app.close()


def _start(cluster, app, name):
    markers = cluster.scratch(f"markers-{name}")
    app.start("fault", np=4, markers=markers, seconds=600,
              env={"HOROVOD_SPARK_TIMEOUT": str(OP_TIMEOUT)})
    deadline = time.monotonic() + 300
    while len(os.listdir(markers)) < 4:
        assert app.proc.poll() is None, f"the driver program exited early:\n{app.read()}"
        assert len(app.answers()) < app.asked, f"the job ended early: {app.answers()[-1]}"
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.5)
    time.sleep(1)  # every rank is inside its allreduce loop
    ranks = {}
    for n in os.listdir(markers):
        with open(os.path.join(markers, n)) as f:
            ranks[int(n[4:-5])] = json.load(f)
    return ranks


def _ancestor(pid, marker: bytes):
    """The nearest process above pid whose command line holds marker."""
    for _ in range(10):
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if marker in f.read():
                return pid
    raise AssertionError(f"no {marker.decode()} above the rank")


def _finished(cluster, app, broken_at):
    result = app.result(timeout=400)
    assert result["error"], "the job finished although it was broken"
    # the failure is noticed within the op timeout, plus Spark's and the log channel's grace
    assert result["failed_at"] - broken_at < OP_TIMEOUT + 30, result
    deadline, left = time.monotonic() + 60, None
    while time.monotonic() < deadline:
        left = cluster.leftovers()
        if not left:
            break
        time.sleep(1)
    assert not left, f"left behind: {left}"
    print(f"\n{result['seconds']:.1f} s to the error: {result['error'].splitlines()[0]}")
    return result["error"]


def _host(cluster, address):
    return next(h for h in cluster.workers if h.address == address)


def test_a_killed_rank_is_named_with_its_host_and_signal(cluster, app):
    ranks = _start(cluster, app, "rank")
    killed_at = time.monotonic()
    os.kill(ranks[3]["pid"], signal.SIGKILL)
    error = _finished(cluster, app, killed_at)
    assert "rank 3" in error and "SIGKILL" in error, error
    assert ranks[3]["host"] in error, error


def test_a_lost_executor_is_named_with_its_host_and_sparks_reason(cluster, app):
    ranks = _start(cluster, app, "executor")
    executor = _ancestor(ranks[1]["pid"], b"CoarseGrainedExecutorBackend")
    killed_at = time.monotonic()
    os.kill(executor, signal.SIGKILL)
    error = _finished(cluster, app, killed_at)
    assert "ExecutorLostFailure" in error and ranks[1]["host"] in error, error
    assert "executor" in error and "137" in error, error


def test_a_lost_worker_is_named_with_its_host_and_sparks_reason(cluster, app):
    """kill -9 of the Worker JVM under rank 1's executor: the executor goes with it."""
    ranks = _start(cluster, app, "worker")
    host = _host(cluster, ranks[1]["host"])
    worker = cluster.spark.workers[host.box.name]
    with open(f"/proc/{worker.pid}/cmdline", "rb") as f:
        assert b"deploy.worker.Worker" in f.read()
    killed_at = time.monotonic()
    os.kill(worker.pid, signal.SIGKILL)
    try:
        error = _finished(cluster, app, killed_at)
    finally:
        worker.wait(timeout=30)
        cluster.restart_worker(host)
    on_host = [r for r, v in ranks.items() if v["host"] == host.address]
    first = error.splitlines()[0]
    assert any(f"rank {r}" in first for r in on_host), error
    assert host.address in first and "ExecutorLostFailure" in error, error


def test_a_cut_off_host_is_named_not_a_healthy_local_rank(cluster, app):
    """A worker host's link goes down mid-allreduce for longer than the op timeout: the
    error names the cut-off host (its leader's TCP timeout), not the healthy local rank
    that waited on its own leader through shared memory."""
    ranks = _start(cluster, app, "cut")
    cut = _host(cluster, ranks[3]["host"])
    cluster.netns.link(cut, up=False)
    cut_at = time.monotonic()
    try:
        deadline = time.monotonic() + OP_TIMEOUT + 90
        while len(app.answers()) < app.asked and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        cluster.netns.link(cut, up=True)  # so that Spark can end the cut-off tasks
    error = _finished(cluster, app, cut_at)
    first = error.splitlines()[0]
    assert cut.address in first and "local peer" not in first, error


def test_a_partition_between_two_hosts_names_both(cluster, app):
    """The two hosts of the job lose each other while both still reach the driver: each
    host's leader times out on the other and both report; the error names the pair (the
    link between them), not one healthy rank picked by arrival order."""
    ranks = _start(cluster, app, "partition")
    a, b = (_host(cluster, addr) for addr in sorted({r["host"] for r in ranks.values()}))
    cluster.netns.partition(a, b, cut=True)
    cut_at = time.monotonic()
    try:
        deadline = time.monotonic() + OP_TIMEOUT + 90
        while len(app.answers()) < app.asked and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        cluster.netns.partition(a, b, cut=False)
    error = _finished(cluster, app, cut_at)
    first = error.splitlines()[0]
    assert "cannot reach each other" in first, error
    assert a.address in first and b.address in first and "local peer" not in first, error
