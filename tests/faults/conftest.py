"""Fixtures of the fault suite: a tagged job environment that is cleaned up whatever happens."""
from __future__ import annotations

import os

import pytest

import _fault_kit as kit

#: Seconds a peer may make no progress before an op fails (HOROVOD_SPARK_TIMEOUT).
TIMEOUT = 10.0
#: Seconds to bootstrap (HOROVOD_SPARK_CONNECT_TIMEOUT).
CONNECT_TIMEOUT = 10.0


class Fault:
    """One test's job: a directory for the ranks' notes and a tag on its processes."""

    def __init__(self, outdir) -> None:
        self.outdir, self.tag = str(outdir), kit.new_tag()

    def env(self, tcp: bool = False, timeout: float = TIMEOUT,
            connect_timeout: float = CONNECT_TIMEOUT, **extra) -> dict:
        env = {kit.TAG_VAR: self.tag, "HOROVOD_SPARK_TIMEOUT": str(timeout),
               "HOROVOD_SPARK_CONNECT_TIMEOUT": str(connect_timeout),
               "HOROVOD_SPARK_FORCE_TCP": "1" if tcp else "0"}
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def cleanup(self) -> None:
        kit.kill_tagged(self.tag)
        pids = [n["pid"] for n in kit.notes(self.outdir, "pid").values()]
        kit.remove_segments(kit.shm_segments(pids))


@pytest.fixture
def fault(tmp_path):
    f = Fault(tmp_path)
    yield f
    f.cleanup()


@pytest.fixture(scope="session")
def spark():
    pytest.importorskip("pyspark")
    os.environ.setdefault("PYSPARK_PYTHON", __import__("sys").executable)
    from horovod_spark._session import get_session

    session = get_session(2)
    if session.sparkContext.defaultParallelism < 2:
        pytest.skip("the Spark session has fewer than 2 slots")
    return session
