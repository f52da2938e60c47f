"""The Spark driver JVM dies while a job runs: run() says so, and cleanup never hides it.

The driver runs in a process of its own (tests/faults/_jvm_dies.py), since the
test kills its JVM: SIGKILL once both ranks are up.  run() must raise
JobFailedError saying "the Spark driver JVM died", not a py4j error from the
cleanup that cancels the job, and no rank may be left behind.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest

import _fault_kit as kit

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.spark
@pytest.mark.slow
def test_a_driver_whose_jvm_dies_raises_a_job_failure_that_says_so(tmp_path):
    done = subprocess.run([sys.executable, os.path.join(HERE, "_jvm_dies.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    raised = [ln for ln in done.stdout.splitlines() if ln.startswith("RAISED ")]
    assert raised, done.stdout[-2000:] + done.stderr[-2000:]
    assert raised[-1].startswith("RAISED JobFailedError: ") and \
        "SparkDriverDied: the Spark driver JVM died while the job ran" in raised[-1], raised
    pids = [json.load(open(os.path.join(tmp_path, f)))["pid"] for f in os.listdir(tmp_path)
            if f.startswith("pid.")]
    assert len(pids) == 2, pids
    kit.wait_until(lambda: not any(_alive(p) for p in pids), 30, "the ranks are gone")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
