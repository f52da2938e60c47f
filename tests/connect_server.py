"""A real Spark Connect server for the tests: pyspark's own, in a process of its own.

`start()` runs `org.apache.spark.sql.connect.service.SparkConnectServer` through
pyspark's spark-submit with a local master, listening on 127.0.0.1 at a free port
and requiring a random token, and returns a `ConnectServer` whose `session()` is a
Connect client of it.  The server is a separate JVM and Python process tree, so the
test process holds no SparkContext for it: the client sees only what Spark Connect
carries, as a notebook on a Connect cluster does.  Its executors import this
checkout (PYTHONPATH).  `stop()` ends the server's process group.

pyspark 3.5 ships no Connect server.  Where `TESTS_CONNECT_SERVER_PYTHON` names a
Python whose pyspark has one (CI's pyspark 4 environment), the server runs from that
pyspark and its executors run that Python, and a 3.5 client talks to it: an older client
on a newer server, as Databricks Connect's 3.5-based clients do.  A 3.5 client sends a
token only over TLS, so such a server takes none; it listens on 127.0.0.1 alone, for the
test run's life.

The client is made with the Connect builder itself, not `SparkSession.builder`,
which would mark the whole test process as a Connect process
(SPARK_CONNECT_MODE_ENABLED) and turn the classic sessions of other tests into
Connect ones; a test that wants the user's Connect mode sets that variable itself
while it runs (see `connect_mode`).
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -Xshare:auto"
SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
SERVER_PYTHON = "TESTS_CONNECT_SERVER_PYTHON"
START_TIMEOUT = 240.0  # seconds: a JVM, Spark and the gRPC service, on two shared cores


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ConnectServer:
    """A running local Spark Connect server (see the module docstring)."""

    def __init__(self, master: str = "local[2]", conf: dict | None = None) -> None:
        python, home = server_python()
        self.master, self.port = master, _free_port()
        # a pre-4 client sends its token only over TLS (see the module docstring)
        self.token = uuid.uuid4().hex if python == sys.executable else None
        self.log = tempfile.NamedTemporaryFile(prefix="hvs-connect-server-", suffix=".log",
                                               delete=False)
        settings = {"spark.connect.grpc.binding.address": "127.0.0.1",
                    "spark.connect.grpc.binding.port": str(self.port),
                    "spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false",
                    "spark.executorEnv.PYTHONPATH": REPO,
                    "spark.pyspark.python": python, **(conf or {})}
        cmd = [os.path.join(home, "bin", "spark-submit"), "--class", SERVER_CLASS,
               "--master", master, "--name", "horovod-spark-tests-connect"]
        for key, value in settings.items():
            cmd += ["--conf", f"{key}={value}"]
        env = dict(os.environ, SPARK_HOME=home, PYSPARK_PYTHON=python, JDK_JAVA_OPTIONS=FAST_JVM,
                   PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
        if self.token is not None:
            env["SPARK_CONNECT_AUTHENTICATE_TOKEN"] = self.token
        env.pop("SPARK_CONNECT_MODE_ENABLED", None)
        env.pop("SPARK_REMOTE", None)
        began = time.monotonic()
        self.proc = subprocess.Popen(cmd + ["spark-internal"], env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        try:
            self._wait_listening()
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - began
        self._session = None

    @property
    def url(self) -> str:
        # "localhost": the client then sends the token over a local channel without TLS
        if self.token is None:
            return f"sc://localhost:{self.port}"
        return f"sc://localhost:{self.port}/;token={self.token}"

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.5).close()
                return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                with open(self.log.name, errors="replace") as f:
                    tail = "".join(f.readlines()[-30:])
                state = f"exited with status {self.proc.returncode}" \
                    if self.proc.returncode is not None else f"not listening after {START_TIMEOUT:g} s"
                raise RuntimeError(f"the Spark Connect server on port {self.port} {state}; "
                                   f"its log ({self.log.name}) ends:\n{tail}")
            time.sleep(0.2)

    def session(self):
        """The Connect client session of this server (one, made on first use)."""
        if self._session is None:
            from pyspark.sql.connect.session import SparkSession as ConnectSession

            self._session = ConnectSession.builder.remote(self.url).create()
        return self._session

    def stop(self) -> None:
        if getattr(self, "_session", None) is not None:
            with contextlib.suppress(Exception):
                self._session.stop()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)


def _has_server(pyspark_home: str) -> bool:
    import glob

    return bool(glob.glob(os.path.join(pyspark_home, "jars", "spark-connect_*.jar")))


def server_python() -> tuple:
    """(the Python whose pyspark runs the server, that pyspark's directory): this one's,
    or the one `TESTS_CONNECT_SERVER_PYTHON` names where this pyspark has no server."""
    import pyspark

    home = os.path.dirname(pyspark.__file__)
    other = os.environ.get(SERVER_PYTHON)
    if _has_server(home) or not other:
        return sys.executable, home
    out = subprocess.run([other, "-c", "import os, pyspark; print(os.path.dirname(pyspark.__file__))"],
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"{SERVER_PYTHON}={other} cannot import pyspark: {out.stderr[-2000:]}")
    return other, out.stdout.strip()


def connect_available() -> str:
    """Why a Connect server and client cannot be made here ("" when they can)."""
    import pyspark

    try:
        import pyspark.sql.connect.session  # noqa: F401  (grpcio, protobuf, ...)
    except Exception as exc:  # the `connect` extra is not installed
        return f"Spark Connect's client is not installed (pip install .[connect]): {exc}"
    if _has_server(os.path.dirname(pyspark.__file__)) or os.environ.get(SERVER_PYTHON):
        return ""
    return (f"pyspark {pyspark.__version__} ships no Spark Connect server (its jar comes from "
            f"Maven, which this machine cannot reach; pyspark 4 bundles it): set "
            f"{SERVER_PYTHON} to a Python with pyspark 4 to run a server from it")


@contextlib.contextmanager
def connect_mode():
    """The process in the user's Connect mode: `SparkSession.getActiveSession()` answers the
    Connect session, as in a notebook on a Connect cluster."""
    before = os.environ.get("SPARK_CONNECT_MODE_ENABLED")
    os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)
        else:
            os.environ["SPARK_CONNECT_MODE_ENABLED"] = before
