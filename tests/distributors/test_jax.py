"""JAX programs unchanged on the job's ranks: `jax.distributed.initialize()` with no
arguments (the job's cluster environment, horovod_spark.jax), JAX's CPU collectives (gloo)
across the ranks, a sharded training step equal to one process's; a failing process named."""
from __future__ import annotations

import importlib.util
import time

import numpy as np
import pytest

import _programs as programs

# (not imported here: this process forks rank processes and Spark workers, which JAX's
# threads make unsafe)
pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                                 reason="jax is not installed (pip install jax)")]


def _one_process_step():
    """The step in one process, by hand: w = 0 - 0.1 * (2/n) x^T (x 0 - y)."""
    x, y = programs.jax_data(2)
    return (0.1 * 2.0 / len(x)) * (x.T @ y)


def test_initialize_without_arguments_joins_the_jobs_ranks_and_their_collectives():
    import horovod_spark

    results = horovod_spark.run(programs.jax_sum_and_step, num_proc=-2)
    assert [(r["rank"], r["size"]) for r in results] == [(0, 2), (1, 2)]
    assert [r["sum"] for r in results] == [3.0, 3.0]  # 1 + 2, across the processes
    want = _one_process_step()
    for r in results:  # the step on data sharded over two processes = one process's
        np.testing.assert_allclose(r["w"], want, rtol=1e-5)


def test_a_process_that_raises_is_named_and_the_other_is_torn_down():
    import horovod_spark

    t0 = time.monotonic()
    with pytest.raises(horovod_spark.JobFailedError) as info:
        horovod_spark.run(programs.jax_fails_on_rank_1, num_proc=-2)
    assert info.value.rank == 1 and "ValueError: process 1 gives up" in str(info.value)
    assert time.monotonic() - t0 < 120


@pytest.mark.spark
def test_on_spark_every_task_is_a_jax_process(spark):
    import horovod_spark

    results = horovod_spark.run(programs.jax_sum_and_step, num_proc=2)
    assert [r["sum"] for r in results] == [3.0, 3.0]
    np.testing.assert_allclose(results[0]["w"], _one_process_step(), rtol=1e-5)
