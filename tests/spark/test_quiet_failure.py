"""A failed rank in a session the user made: the JobFailedError alone, not Spark's logs of it.

Spark's Executor and TaskSetManager would log the task's failure (a JVM stack and the
base64 record the driver parses) into the user's output; the driver turns them off
while the job runs and gives them back their levels a few seconds after.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from _spark_support import REPO, fast_jvm_env

USER = textwrap.dedent("""
    import sys
    from pyspark.sql import SparkSession
    spark = (SparkSession.builder.master("local[2]").appName("a user's own session")
             .config("spark.pyspark.python", sys.executable)
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    from horovod_spark import HorovodRunner, JobFailedError

    def level():
        manager = spark._jvm.org.apache.logging.log4j.LogManager
        return [str(manager.getLogger(name).getLevel()) for name in (
            "org.apache.spark.executor.Executor", "org.apache.spark.scheduler.TaskSetManager")]

    def train():
        import time
        import horovod_spark.torch as hvd
        hvd.init()
        if hvd.rank() == 1:
            raise ValueError("rank one gives up")
        time.sleep(60)

    before = level()
    try:
        HorovodRunner(np=2).run(train)
    except JobFailedError as exc:
        print("caught:", str(exc).splitlines()[0], flush=True)
    import time
    deadline = time.monotonic() + 30  # they stay off a few seconds after the job
    while level() != before and time.monotonic() < deadline:
        time.sleep(0.5)
    print("levels kept:", level() == before, before, flush=True)
""")


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_failed_rank_in_the_users_session_prints_no_spark_failure_log(tmp_path):
    pytest.importorskip("torch")
    (tmp_path / "user.py").write_text(USER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HVS_", "HOROVOD_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "user.py"], cwd=tmp_path, env=fast_jvm_env(env),
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "caught: job on rank 1/2: ValueError: rank one gives up" in done.stdout, done.stdout
    assert "levels kept: True" in done.stdout, done.stdout
    for noise in ("HVS-FAILURE", "ERROR Executor", "TaskSetManager", "PythonException"):
        assert noise not in done.stderr, (noise, done.stderr[-3000:])
