"""Suite-wide settings: the rank processes of every test inherit them."""
import os
import sys

import pytest

# Two cores are shared by every rank of a test: one thread each keeps them from thrashing.
for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
            "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"):
    os.environ.setdefault(var, "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)


@pytest.fixture(scope="session")
def connect_server():
    """A real local Spark Connect server, shared by every test of the run (see
    tests/connect_server.py); skipped, saying why, where the connect extra is missing."""
    from connect_server import ConnectServer, connect_available

    why = connect_available()
    if why:
        pytest.skip(why)
    server = ConnectServer()
    sys.stderr.write(f"\n[Spark Connect server up in {server.start_seconds:.1f} s]\n")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def spark():
    """The local[2] Spark session the runner would use (one a module; the estimator and
    spark suites make their own)."""
    pytest.importorskip("pyspark")
    from horovod_spark._job.session import get_session

    session = get_session(2)
    if session.sparkContext.defaultParallelism < 2:
        pytest.skip("the Spark session has fewer than 2 slots")
    return session
