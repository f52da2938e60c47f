"""A Spark standalone cluster on the emulated hosts, from pyspark's own jars.

The head host runs the Master and the driver programs; each worker box runs
one Worker that binds its host's address and keeps its executors' work
directories in its own /tmp.  A driver program is a Python script run in the
head box as a subprocess (the test process is in no namespace); it prints one
`RESULT {json}` line.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

from _hosts import Box, Host, Netns, result_lines

__all__ = ["Standalone", "App", "ConnectServer", "ROOT"]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAST_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"  # short-lived JVMs on shared cores
PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_program.py")
MASTER_PORT = 7077


def _spark_home() -> str:
    import pyspark

    return os.path.dirname(os.path.abspath(pyspark.__file__))


class Standalone:
    """A Master on `head`, Workers on boxes, and driver programs on `head`."""

    def __init__(self, netns: Netns, head: Host, logs: str) -> None:
        self.netns, self.head, self.logs = netns, head, logs
        self.home = _spark_home()
        self.url = f"spark://{head.address}:{MASTER_PORT}"
        self.workers: Dict[str, subprocess.Popen] = {}
        self.env = self._base_env()
        self.master = head.box.spawn(
            [f"{self.home}/bin/spark-class", "org.apache.spark.deploy.master.Master",
             "--host", head.address, "--port", str(MASTER_PORT), "--webui-port", "8080"],
            self._env(head), self._log("master"))

    def _base_env(self) -> Dict[str, str]:
        keep = ("PATH", "HOME", "LANG", "JAVA_HOME", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                "OPENBLAS_NUM_THREADS", "TF_CPP_MIN_LOG_LEVEL")
        env = {k: os.environ[k] for k in keep if k in os.environ}
        env.update(SPARK_HOME=self.home, PYSPARK_PYTHON=sys.executable,
                   PYSPARK_DRIVER_PYTHON=sys.executable, PYTHONPATH=ROOT,
                   SPARK_DAEMON_MEMORY="256m", SPARK_NO_DAEMONIZE="1",
                   SPARK_DAEMON_JAVA_OPTS="-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
                   PYTHONDONTWRITEBYTECODE="1")
        env.setdefault("OMP_NUM_THREADS", "1")
        return env

    def _env(self, host: Host, **extra: str) -> Dict[str, str]:
        return {**self.env, "SPARK_LOCAL_IP": host.address, "SPARK_LOCAL_HOSTNAME": host.address,
                **extra}

    def _log(self, name: str) -> str:
        return os.path.join(self.logs, f"{name}.log")

    def add_workers(self, boxes: Sequence[Box], cores: int, memory: str = "3g") -> None:
        """A Worker in each box, offering `cores` cores; all registered on return."""
        before = self._registered()
        for box in boxes:
            self._start_worker(box, cores, memory)
        self.wait_workers(before + len(boxes))

    def _start_worker(self, box: Box, cores: int, memory: str) -> subprocess.Popen:
        proc = box.spawn([f"{self.home}/bin/spark-class", "org.apache.spark.deploy.worker.Worker",
                          "--host", box.host.address, "--cores", str(cores), "--memory", memory,
                          "--work-dir", "/tmp/spark-work", "--webui-port", "0", self.url],
                         self._env(box.host), self._log(f"worker-{box.name}"))
        self.workers[box.name] = proc
        return proc

    def _registered(self) -> int:
        try:
            with open(self._log("master")) as f:
                return len(re.findall(r"Registering worker", f.read()))
        except FileNotFoundError:
            return 0

    def wait_workers(self, count: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while self._registered() < count:
            if self.master.poll() is not None:
                raise RuntimeError(f"the Master exited: {self.tail('master')}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{count} Workers never registered: {self.tail('master')}")
            time.sleep(0.2)

    def stop_worker(self, box: Box) -> None:
        proc = self.workers.pop(box.name)
        proc.kill()
        proc.wait(timeout=30)

    def tail(self, name: str, chars: int = 4000) -> str:
        try:
            with open(self._log(name)) as f:
                return f.read()[-chars:]
        except FileNotFoundError:
            return "(no log)"

    def driver_env(self) -> Dict[str, str]:
        """The environment of a driver program in the head box (`_program.session` reads it)."""
        return {**self._env(self.head), "CLUSTER_TEST_MASTER": self.url,
                "CLUSTER_TEST_DRIVER_HOST": self.head.address}

    def app(self, name: str, layout: dict, env: Optional[Dict[str, str]] = None) -> "App":
        """A driver program (one Spark app) in the head box, serving scenarios; see `App`."""
        full = {**self.driver_env(), **(env or {})}
        return App(self.head.box, full, os.path.join(self.logs, f"app-{name}-{time.time_ns()}.log"),
                   layout)

    def connect_server(self, name: str, cores: int, executor_cores: int) -> "ConnectServer":
        """A Spark Connect server in the head box: an app of this cluster whose clients
        connect on the head's loopback."""
        return ConnectServer(self, name, cores, executor_cores)

    def restart_worker(self, box: Box, cores: int, memory: str = "3g") -> None:
        """A new Worker in `box` (after a test killed the old one), registered on return."""
        self.workers.pop(box.name, None)
        before = self._registered()
        self._start_worker(box, cores, memory)
        self.wait_workers(before + 1)



class App:
    """One driver program, one Spark app, running the scenarios the tests ask for.

    The program (`_program.py`) starts a session of `layout` (np, executor
    cores, conf), then reads one request a line from its stdin, runs that
    scenario and prints one `RESULT {json}` line; a scenario that raised
    answers {"exception": its traceback}.  Closing its stdin stops the app.
    Tests of one layout share it, so they pay for its JVMs and its warm
    rank starts once.
    """

    def __init__(self, box: Box, env: Dict[str, str], log: str, layout: dict) -> None:
        self.log = log
        self.proc = box.spawn([sys.executable, PROGRAM, json.dumps(layout)], env, log,
                              stdin=subprocess.PIPE)
        self.asked = 0

    def start(self, scenario: str, **args) -> None:
        """Ask for a scenario; its answer is the next `result`."""
        self.proc.stdin.write((json.dumps({"scenario": scenario, "args": args}) + "\n").encode())
        self.proc.stdin.flush()
        self.asked += 1

    def read(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()

    def answers(self) -> List[dict]:
        return result_lines(self.read())

    def result(self, timeout: float = 480.0) -> dict:
        """The answer to the last request, within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while len(self.answers()) < self.asked:
            if self.proc.poll() is not None:
                raise AssertionError(f"the driver program exited {self.proc.returncode}:\n"
                                     f"{self.read()[-8000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the driver program gave no answer in {timeout} s:\n"
                                     f"{self.read()[-8000:]}")
            time.sleep(0.2)
        answer = self.answers()[self.asked - 1]
        if "exception" in answer:
            raise AssertionError(f"the scenario raised in the driver program:\n"
                                 f"{answer['exception']}")
        return answer

    def run(self, scenario: str, timeout: float = 480.0, **args) -> dict:
        self.start(scenario, **args)
        return self.result(timeout)

    def close(self, timeout: float = 60.0) -> None:
        """Stop the app (its executors free their cores), killing it if it does not stop."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=timeout)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


class ConnectServer:
    """pyspark's Spark Connect server as a driver of the cluster, in the head box.

    It listens on the head's loopback with a random token (a client elsewhere would need
    TLS to send one), so its clients are driver programs in the head box (`url`).
    """

    CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"

    def __init__(self, spark: Standalone, name: str, cores: int, executor_cores: int) -> None:
        import uuid

        self.port, self.token = 15000 + os.getpid() % 1000, uuid.uuid4().hex
        self.url = f"sc://localhost:{self.port}/;token={self.token}"
        conf = {"spark.connect.grpc.binding.address": "127.0.0.1",
                "spark.connect.grpc.binding.port": str(self.port),
                "spark.driver.host": spark.head.address,
                "spark.driver.bindAddress": spark.head.address,
                "spark.cores.max": str(cores), "spark.executor.cores": str(executor_cores),
                "spark.executor.memory": "600m", "spark.ui.enabled": "false",
                "spark.executor.extraJavaOptions": FAST_JVM,
                "spark.executorEnv.PYTHONPATH": ROOT, "spark.executorEnv.OMP_NUM_THREADS": "1",
                "spark.pyspark.python": sys.executable}
        cmd = [f"{spark.home}/bin/spark-submit", "--class", self.CLASS, "--master", spark.url,
               "--name", name, "--driver-java-options", FAST_JVM]
        for key, value in conf.items():
            cmd += ["--conf", f"{key}={value}"]
        # spark-submit sizes this server's JVM as a daemon's (SPARK_DAEMON_MEMORY), not a driver's
        env = {**spark._env(spark.head), "SPARK_CONNECT_AUTHENTICATE_TOKEN": self.token,
               "SPARK_DAEMON_MEMORY": "600m"}
        self.log = os.path.join(spark.logs, f"connect-{name}.log")
        self.proc = spark.head.box.spawn(cmd + ["spark-internal"], env, self.log)

    def stop(self) -> None:
        """SIGTERM, so that the app ends and the Master frees its cores; then SIGKILL."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
