"""The Spark session a job runs on: the active one, or an embedded local one.

With no active SparkSession (a bare `python train.py`), the runner starts
`local[N]` itself, N = max(cores, ranks asked for), so `HorovodRunner(np=2)`
works without any Spark setup.  The executors' Python is the running
interpreter (PYSPARK_PYTHON), and the directory this package was imported
from goes on their PYTHONPATH, so a source checkout works as well as an
installed package.  Spark's console chatter is turned down to errors.
"""
from __future__ import annotations

import os
import sys
import tempfile
import warnings
from typing import Mapping, Optional

__all__ = ["get_session", "embedded_master", "package_root"]

_LOG4J = """\
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n
# a failed rank is reported once, by JobFailedError, not also by every scheduler layer
logger.executor.name = org.apache.spark.executor.Executor
logger.executor.level = off
logger.tasksetmanager.name = org.apache.spark.scheduler.TaskSetManager
logger.tasksetmanager.level = off
# with a level of its own, the launcher does not announce "Setting default log level"
logger.gateway.name = org.apache.spark.api.python.PythonGatewayServer
logger.gateway.level = error
"""


def package_root() -> str:
    """The directory holding the `horovod_spark` and `collectives` packages."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # horovod_spark/
    return os.path.dirname(package)


def embedded_master(np_hint: int = 0) -> str:
    return f"local[{max(os.cpu_count() or 1, abs(np_hint), 1)}]"


def _python_path() -> str:
    parts = [package_root()] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys(parts))


def _log4j_file() -> str:
    fd, path = tempfile.mkstemp(prefix="horovod_spark_log4j2_", suffix=".properties")
    with os.fdopen(fd, "w") as f:
        f.write(_LOG4J)
    return path


def _start_embedded(np_hint: int, conf: Mapping[str, str]):
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    log4j = _log4j_file()
    java_opts = f"-Dlog4j.configurationFile=file:{log4j}"
    try:
        spark = _build(np_hint, java_opts, conf)
    finally:  # the JVM read it at startup
        os.unlink(log4j)
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _build(np_hint: int, java_opts: str, conf: Mapping[str, str]):
    from pyspark.sql import SparkSession

    builder = (SparkSession.builder.master(embedded_master(np_hint))
             .appName("horovod-spark")
             .config("spark.pyspark.python", os.environ["PYSPARK_PYTHON"])
             .config("spark.executorEnv.PYTHONPATH", _python_path())
             .config("spark.driver.extraJavaOptions", java_opts)
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.ui.enabled", "false"))
    for key, value in conf.items():  # the caller's settings win over the defaults above
        builder = builder.config(key, value)
    with warnings.catch_warnings():  # PySpark's own pandas-version notice, not the user's
        warnings.filterwarnings("ignore", "PySpark does not yet fully support pandas")
        return builder.getOrCreate()


def get_session(np_hint: int = 0, start: bool = True, conf: Optional[Mapping[str, str]] = None):
    """The active SparkSession; else a session on the active SparkContext; else embedded.

    `conf` (Spark settings) applies to a session this call starts: under spark-submit
    or the embedded one.  Returns None when there is none and `start` is False.
    """
    conf = dict(conf or {})
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    spark: Optional[SparkSession] = SparkSession.getActiveSession()
    if spark is not None:
        return spark
    if os.environ.get("SPARK_REMOTE") or os.environ.get("SPARK_CONNECT_MODE_ENABLED"):
        return SparkSession.builder.getOrCreate()  # Spark Connect: a client of that server
    if SparkContext._active_spark_context is not None:
        return SparkSession(SparkContext._active_spark_context)
    if os.environ.get("PYSPARK_GATEWAY_PORT"):  # under spark-submit: its master and conf
        builder = SparkSession.builder
        for key, value in conf.items():
            builder = builder.config(key, value)
        return builder.getOrCreate()
    return _start_embedded(np_hint, conf) if start else None
