"""A Spark standalone cluster on the emulated hosts, from pyspark's own jars.

The head host runs the Master and the driver programs; each worker box runs
one Worker that binds its host's address and keeps its executors' work
directories in its own /tmp.  A driver program is a Python script run in the
head box as a subprocess (the test process is in no namespace); it prints one
`RESULT {json}` line.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

from _hosts import Box, Host, Netns, result_line

__all__ = ["Standalone", "ROOT"]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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

    def driver(self, script: str, args: Sequence[str] = (), env: Optional[Dict[str, str]] = None,
               timeout: float = 480.0) -> subprocess.Popen:
        """Start a driver program in the head box; read it with `finish`."""
        full = {**self._env(self.head), "CLUSTER_TEST_MASTER": self.url,
                "CLUSTER_TEST_DRIVER_HOST": self.head.address, **(env or {})}
        log = open(os.path.join(self.logs, f"driver-{os.path.basename(script)}-{time.time_ns()}.log"),
                   "w+")
        proc = self.head.box.spawn([sys.executable, script, *args], full, log.name)
        proc.log, proc.limit = log, timeout
        return proc

    def finish(self, proc: subprocess.Popen) -> dict:
        try:
            proc.wait(timeout=proc.limit)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(f"the driver program ran past {proc.limit} s:\n"
                                 f"{self._read(proc)[-8000:]}") from None
        out = self._read(proc)
        if proc.returncode != 0:
            raise AssertionError(f"the driver program exited {proc.returncode}:\n{out[-8000:]}")
        return result_line(out)

    def run_driver(self, script: str, args: Sequence[str] = (), **kw) -> dict:
        return self.finish(self.driver(script, args, **kw))

    @staticmethod
    def _read(proc) -> str:
        proc.log.seek(0)
        return proc.log.read()

    def hosts_of(self, boxes: List[Box]) -> List[str]:
        return [b.host.address for b in boxes]
