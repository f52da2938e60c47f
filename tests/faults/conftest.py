"""Fixtures of the fault suite: a tagged job environment that is cleaned up whatever happens."""
from __future__ import annotations

import os
import sys

import pytest

import _fault_kit as kit

TIMEOUT, CONNECT_TIMEOUT = kit.TIMEOUT, kit.CONNECT_TIMEOUT


@pytest.fixture
def fault(tmp_path):
    job = kit.FaultJob(tmp_path)
    yield job
    job.cleanup()


@pytest.fixture(scope="session")
def spark():
    pytest.importorskip("pyspark")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from horovod_spark._job.session import get_session

    session = get_session(2)
    if session.sparkContext.defaultParallelism < 2:
        pytest.skip("the Spark session has fewer than 2 slots")
    return session
