"""Faults on the emulated cluster: a killed rank, a killed executor JVM.

Each test starts a job of 4 ranks on 2 hosts that allreduces until it is
broken from outside, breaks it, and reads the driver's error: it names the
culprit (rank, host, cause) within the op timeout, and afterwards no rank
process, zygote or /dev/shm entry is left on any host.
"""
import json
import os
import signal
import time

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(900)]

PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_program.py")
OP_TIMEOUT = 20  # HOROVOD_SPARK_TIMEOUT of these jobs: the bound on noticing a loss


def _start(cluster, name):
    markers = cluster.scratch(f"markers-{name}")
    proc = cluster.spark.driver(PROGRAM, ["fault", json.dumps(
        {"np": 4, "executor_cores": 2, "markers": markers, "seconds": 600,
         "env": {"HOROVOD_SPARK_TIMEOUT": str(OP_TIMEOUT)}})], timeout=400)
    deadline = time.monotonic() + 300
    while len(os.listdir(markers)) < 4:
        assert proc.poll() is None, f"the driver program exited early:\n{cluster.spark._read(proc)}"
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.5)
    time.sleep(1)  # every rank is inside its allreduce loop
    ranks = {}
    for n in os.listdir(markers):
        with open(os.path.join(markers, n)) as f:
            ranks[int(n[4:-5])] = json.load(f)
    return proc, ranks


def _executor_of(pid):
    """The executor JVM above a rank process (its task's worker's parent chain)."""
    for _ in range(10):
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"CoarseGrainedExecutorBackend" in f.read():
                return pid
    raise AssertionError("no executor JVM above the rank")


def _finished(cluster, proc, killed_at):
    result = cluster.spark.finish(proc)
    assert result["error"], "the job finished although a rank was killed"
    # the failure is noticed within the op timeout, plus Spark's and the log channel's grace
    assert result["failed_at"] - killed_at < OP_TIMEOUT + 30, result
    deadline, left = time.monotonic() + 60, None
    while time.monotonic() < deadline:
        left = cluster.leftovers()
        if not left:
            break
        time.sleep(1)
    assert not left, f"left behind: {left}"
    return result["error"]


def test_a_killed_rank_is_named_with_its_host_and_signal(cluster):
    proc, ranks = _start(cluster, "rank")
    killed_at = time.monotonic()
    os.kill(ranks[3]["pid"], signal.SIGKILL)
    error = _finished(cluster, proc, killed_at)
    assert "rank 3" in error and "SIGKILL" in error, error
    assert ranks[3]["host"] in error, error


def test_a_lost_executor_is_named_with_its_host_and_sparks_reason(cluster):
    proc, ranks = _start(cluster, "executor")
    executor = _executor_of(ranks[1]["pid"])
    killed_at = time.monotonic()
    os.kill(executor, signal.SIGKILL)
    error = _finished(cluster, proc, killed_at)
    assert "ExecutorLostFailure" in error and ranks[1]["host"] in error, error
    assert "executor" in error and "137" in error, error


def test_a_cut_off_host_is_named_not_a_healthy_local_rank(cluster):
    """A worker host's link goes down mid-allreduce for longer than the op timeout: the
    error names the cut-off host (its leader's TCP timeout), not the healthy local rank
    that waited on its own leader through shared memory."""
    proc, ranks = _start(cluster, "partition")
    cut = next(h for h in cluster.workers if h.address == ranks[3]["host"])
    cluster.netns.link(cut, up=False)
    killed_at = time.monotonic()
    try:
        deadline = time.monotonic() + OP_TIMEOUT + 90
        while "RESULT " not in cluster.spark._read(proc) and time.monotonic() < deadline:
            assert proc.poll() is None or "RESULT " in cluster.spark._read(proc)
            time.sleep(0.5)
    finally:
        cluster.netns.link(cut, up=True)  # so that Spark can end the cut-off tasks
    error = _finished(cluster, proc, killed_at)
    first = error.splitlines()[0]
    assert cut.address in first and "local peer" not in first, error
