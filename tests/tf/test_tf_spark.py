"""horovod_spark.keras under the Spark runner: horovod_spark.run(fn, num_proc=2) on local[2].

The same checks as the local-launcher tests, run as two barrier tasks: each
Spark task starts its rank process, the ranks bootstrap from the tasks'
addresses, and every rank's results come back to the driver in rank order.
"""
from __future__ import annotations

import os
import sys

import cloudpickle
import pytest

import _keras_checks
import _tf_ops_checks
from _tf_support import REPO, TF_ENV, assert_ok, requires_tf

pytestmark = [pytest.mark.tf, pytest.mark.spark, pytest.mark.slow, requires_tf]

# the executors cannot import tests/: the checks travel by value
cloudpickle.register_pickle_by_value(_keras_checks)
cloudpickle.register_pickle_by_value(_tf_ops_checks)
cloudpickle.register_pickle_by_value(sys.modules["_tf_support"])  # their run_all's run_named
cloudpickle.register_pickle_by_value(sys.modules[__name__])

OPS = ["placement_matches_the_launcher", "ops_run_through_the_fusion_engine",
       "allreduce_every_op_and_dtype_matches_numpy",
       "distributed_gradient_tape_averages_eagerly_and_in_tf_function"]
KERAS = ["fit_matches_single_process_training_on_the_global_batch",
         "metric_average_callback_averages_every_rank_s_metrics"]


def _rank_body():
    results = _tf_ops_checks.run_all(OPS)
    results.update(_keras_checks.run_all(KERAS))
    return results


@pytest.fixture(scope="module")
def spark():
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        yield active
        return
    path = os.pathsep.join([REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    session = (SparkSession.builder.master("local[2]").appName("horovod-spark-tf-tests")
               .config("spark.pyspark.python", sys.executable)
               .config("spark.executorEnv.PYTHONPATH", path)
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="module")
def results(spark):
    import horovod_spark

    per_rank = horovod_spark.run(_rank_body, num_proc=2, env=TF_ENV, start_timeout=120)
    assert len(per_rank) == 2
    return {name: [res[name] for res in per_rank] for name in per_rank[0]}


@pytest.mark.parametrize("check", OPS + KERAS)
def test_check_passes_on_every_spark_rank(results, check):
    assert_ok(results, check)
