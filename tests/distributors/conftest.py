"""Fixtures of the DeepSpeed, tf.distribute and JAX suites: one local[2] Spark session per module."""
from __future__ import annotations

import os
import sys

import pytest


@pytest.fixture(scope="module")
def spark():
    pytest.importorskip("pyspark")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from horovod_spark._job.session import get_session

    session = get_session(2)
    if session.sparkContext.defaultParallelism < 2:
        pytest.skip("the Spark session has fewer than 2 slots")
    return session

