"""Helpers for the Spark tests: real sessions, rank-process counting, fake GPUs.

Each test module starts one session with a module-scoped fixture and stops it
at the end, so modules can use different masters (local[2], local-cluster).
Rank functions are pickled by value (`by_value`), so executors need only the
repository on their PYTHONPATH, never the test modules.
"""
from __future__ import annotations

import os
import stat
import sys
import time
import uuid

import cloudpickle
import psutil

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

# A discovery script that hands out GPU addresses 0, 1, 2, ... one per call (one per
# worker of a local-cluster), so each executor, and so each rank, owns a distinct GPU.
GPU_SCRIPT = """#!/bin/bash
exec 9>>"{dir}/lock"
flock 9
n=$(cat "{dir}/count" 2>/dev/null || echo 0)
echo $((n + 1)) > "{dir}/count"
echo "{{\\"name\\": \\"gpu\\", \\"addresses\\": [\\"$n\\"]}}"
"""


# Test JVMs live for seconds: C1 alone and the serial GC start them 2-3x faster on two
# shared cores (local-cluster: ~40 s instead of ~110 s under load).  Product defaults keep
# the JVM's own choices; only the tests' JVMs are started this way.
FAST_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -Xshare:auto"


def fast_jvm_env(env: dict) -> dict:
    """`env` for a subprocess whose JVMs should start fast (see FAST_JVM)."""
    return dict(env, JDK_JAVA_OPTIONS=FAST_JVM)


def by_value(module_name: str) -> None:
    """Pickle the rank functions of a test module by value (with pyspark's own copy of
    cloudpickle too, which pickles the functions of a DataFrame's mapInArrow)."""
    from pyspark import cloudpickle as spark_cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[module_name])
    spark_cloudpickle.register_pickle_by_value(sys.modules[module_name])


def start_session(master: str, conf: dict | None = None):
    import pyspark
    from pyspark.sql import SparkSession

    os.environ.setdefault("SPARK_HOME", os.path.dirname(pyspark.__file__))
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = (SparkSession.builder.master(master).appName("horovod-spark-tests")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.executorEnv.PYTHONPATH", REPO)
               .config("spark.driver.extraJavaOptions", FAST_JVM)
               .config("spark.executor.extraJavaOptions", FAST_JVM))
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    from pyspark import SparkContext

    active = SparkContext._active_spark_context  # left by an earlier module (or the embedded default)
    # a context's own settings (maxResultSize, resources) are fixed when it starts: a module
    # that needs others than the running context's gets a context of its own
    if active is not None and (active.master != master or any(
            active.getConf().get(k) != str(v) for k, v in (conf or {}).items())):
        active.stop()
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def stop_session(spark, conf: dict | None = None) -> None:
    """Stop a session and forget its settings.

    The first session of a process passes its settings to the JVM it launches, as Java
    system properties, and every later SparkConf in that JVM reads them back: without
    this, one module's GPU amounts would follow the next module's local[2] session.
    """
    jvm = spark.sparkContext._jvm
    spark.stop()
    for key in list(conf or {}) + ["spark.driver.extraJavaOptions", "spark.executor.extraJavaOptions"]:
        jvm.java.lang.System.clearProperty(key)
    jvm.java.lang.System.clearProperty("spark.master")


def write_gpu_script(directory: str) -> str:
    path = os.path.join(directory, "discover_gpus.sh")
    with open(path, "w") as f:
        f.write(GPU_SCRIPT.format(dir=directory))
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
    return path


def new_tag() -> str:
    """A value for the HVS_TEST_TAG variable, which marks this test's rank processes."""
    return uuid.uuid4().hex


def _forked_rank(proc) -> bool:
    """A rank process forked from a zygote (horovod_spark._job.warm): its /proc environment is
    the zygote's, so its tag cannot be read; every live one counts."""
    try:
        parent = proc.parent()
        return parent is not None and "collectives.launch.zygote" in " ".join(parent.cmdline()) and \
            "collectives.launch.zygote" in " ".join(proc.cmdline())
    except psutil.Error:
        return False


def rank_processes(tag: str) -> list:
    """Live rank processes (on any executor of this machine) of the job tagged `tag`, and
    any rank forked from a zygote (whose tag cannot be read)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if ("collectives.launch.worker" in " ".join(proc.info["cmdline"] or []) and
                    proc.environ().get("HVS_TEST_TAG") == tag) or _forked_rank(proc):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def wait_until_no_rank_processes(tag: str, timeout: float = 30.0) -> list:
    """Rank processes still alive after `timeout` (expected: none)."""
    deadline = time.monotonic() + timeout
    while True:
        left = rank_processes(tag)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def alive_after(pids, timeout: float = 30.0) -> list:
    """Those of `pids` still alive (not zombies) after `timeout` seconds (expected: none)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)
