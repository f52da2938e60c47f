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


PRINTS = textwrap.dedent("""
    import sys, time
    from pyspark.sql import SparkSession
    spark = (SparkSession.builder.master("local[2]").appName("a user's own session")
             .config("spark.pyspark.python", sys.executable)
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    from horovod_spark import HorovodRunner
    from horovod_spark._job.quiet import LINGER_S

    def spark_job(mark):
        print(f"MARK {mark}", file=sys.stderr, flush=True)
        spark.sparkContext.parallelize(range(8), 2).map(lambda x: x + 1).count()
        time.sleep(0.5)  # what it logs reaches stderr before the next mark

    def own_configs():
        config = spark._jvm.org.apache.logging.log4j.core.LoggerContext.getContext(False) \
            .getConfiguration()
        return sorted(str(n) for n in config.getLoggers().keySet())

    spark_job("before")
    print("configured before:", own_configs(), flush=True)
    print("rank 0 says", HorovodRunner(np=2).run(lambda: 7), flush=True)
    time.sleep(LINGER_S + 2)  # the loggers come back after the job
    print("configured after:", own_configs(), flush=True)
    spark_job("after")
    spark.sparkContext.setLogLevel("ERROR")  # the user's own setting, later
    spark_job("error")
    print("MARK end", file=sys.stderr, flush=True)
""")


@pytest.mark.spark
@pytest.mark.timeout(300)
def test_a_job_leaves_the_users_session_printing_what_it_printed_before(tmp_path):
    """Executor and TaskSetManager inherit their level again after a job (no configuration
    of their own is left): Spark's console filter drops their INFO lines as before."""
    (tmp_path / "user.py").write_text(PRINTS)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HVS_", "HOROVOD_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "user.py"], cwd=tmp_path, env=fast_jvm_env(env),
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0 says 7" in done.stdout
    sections, name = {}, None
    for line in done.stderr.splitlines():
        if line.startswith("MARK "):
            name = line.split()[1]
            sections[name] = []
        elif name is not None:
            sections[name].append(line)

    def spark_lines(section):
        return [line for line in sections[section]
                if " INFO Executor" in line or " INFO TaskSetManager" in line]

    assert spark_lines("before") == [], sections["before"]
    assert spark_lines("after") == [], sections["after"]  # were printed, after a job
    assert spark_lines("error") == [], sections["error"]
    configured = [line.split(":", 1)[1] for line in done.stdout.splitlines()
                  if line.startswith("configured ")]
    assert len(configured) == 2 and configured[0] == configured[1], done.stdout  # inherited
