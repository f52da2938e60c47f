"""JobFailedError survives pickling: a run() called in a worker pool or a
subprocess hands its caller the real error (rank, message, traceback)."""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import pickle

import pytest

from horovod_spark import JobFailedError

pytestmark = pytest.mark.timeout(120)


def _failing_job() -> None:
    import io

    import horovod_spark

    def fails():
        import os
        if os.environ["HVS_RANK"] == "1":
            raise ValueError("bad shard in a pool")
        return 0

    horovod_spark.run(fails, num_proc=-2, stdout=io.StringIO(), stderr=io.StringIO())


def test_a_job_failed_in_a_worker_pool_arrives_as_itself():
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        with pytest.raises(JobFailedError, match=r"rank 1/2: ValueError: bad shard in a pool") as info:
            pool.submit(_failing_job).result(timeout=100)
    err = info.value
    assert (err.rank, err.size, err.error_type) == (1, 2, "ValueError")
    assert 'raise ValueError("bad shard in a pool")' in err.remote_traceback
    assert isinstance(err.original(), ValueError)


def test_a_pickled_job_error_keeps_its_text_and_fields():
    try:
        _failing_job()
    except JobFailedError as exc:
        err = exc
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is JobFailedError and str(copy) == str(err)
    assert (copy.rank, copy.attempt, copy.attempts, copy.output_tail) == \
        (err.rank, err.attempt, err.attempts, err.output_tail)
