"""tf.distribute programs unchanged on the job's ranks, and spark-tensorflow-distributor's
MirroredStrategyRunner's face: every rank finds its workers in TF_CONFIG; a custom loop's
all-reduce and Keras' model.fit run under MultiWorkerMirroredStrategy; the chief's value
comes back; a failing worker is named with its traceback."""
from __future__ import annotations

import time

import numpy as np
import pytest

import _programs as programs

pytest.importorskip("tensorflow")
pytestmark = [pytest.mark.tf, pytest.mark.timeout(300)]


def _runner(**kw):
    from horovod_spark import MirroredStrategyRunner

    return MirroredStrategyRunner(**{"num_slots": 2, "local_mode": True, "use_gpu": False, **kw})


def test_a_custom_step_all_reduces_over_the_workers_of_tf_config():
    value = _runner().run(programs.tf_custom_loop)
    assert value["strategy"] == "CollectiveAllReduceStrategy"  # MultiWorkerMirroredStrategy's class
    assert value["replicas"] == 2 and value["sum"] == 3.0  # 1 + 2
    assert len(value["workers"]) == 2 and len(set(value["workers"])) == 2


def test_keras_fit_trains_under_the_runners_strategy_alike_on_every_worker():
    pytest.importorskip("tf_keras", reason="tf_keras (Keras 2) is not installed: "
                        "pip install --no-deps tf_keras, as .ci/run does")
    import horovod_spark

    from horovod_spark.tf_distributor import _InStrategy

    # every rank's value (run), the function wrapped as the runner wraps it
    results = horovod_spark.run(_InStrategy(programs.tf_keras_fit), num_proc=-2,
                                env={"CUDA_VISIBLE_DEVICES": ""})
    np.testing.assert_array_equal(results[0]["weights"], results[1]["weights"])
    assert results[0]["loss"][-1] < results[0]["loss"][0]
    chief = _runner().run(programs.tf_keras_fit, epochs=2)  # kwargs reach the function
    assert chief["weights"] == results[0]["weights"]


@pytest.mark.xfail(strict=True, reason="Keras 3's model.fit does not run under "
                   "MultiWorkerMirroredStrategy (keras-team/keras#20585, "
                   "tensorflow/tensorflow#72388): docs/distributors.md says to use tf_keras")
def test_keras_3_fit_under_the_strategy():
    from horovod_spark import JobFailedError

    try:
        _runner().run(programs.tf_keras_fit, legacy=False)
    except JobFailedError as exc:
        assert "PerReplica" in str(exc)  # the known failure, not another
        raise


def test_use_custom_strategy_leaves_the_strategy_to_the_function():
    value = _runner(use_custom_strategy=True).run(programs.tf_own_strategy)
    assert value == {"replicas": 2, "outer": "_DefaultDistributionStrategy"}


def test_bad_arguments_are_refused_as_spark_tensorflow_distributor_refuses_them():
    from horovod_spark import MirroredStrategyRunner

    with pytest.raises(ValueError, match="num_slots is set to 0 but cannot be less than or "
                                         "equal to 0"):
        MirroredStrategyRunner(num_slots=0)
    with pytest.raises(TypeError):
        MirroredStrategyRunner(2)  # keyword-only, as there


def test_a_worker_that_raises_is_named_and_the_others_are_torn_down():
    from horovod_spark import JobFailedError

    t0 = time.monotonic()
    with pytest.raises(JobFailedError) as info:
        _runner().run(programs.tf_fails_on_rank_1)
    assert info.value.rank == 1 and "ValueError: worker 1 gives up" in str(info.value)
    assert time.monotonic() - t0 < 120


@pytest.mark.spark
def test_on_spark_each_task_is_a_worker(spark):
    from horovod_spark import MirroredStrategyRunner

    value = MirroredStrategyRunner(num_slots=2, use_gpu=False).run(programs.tf_custom_loop)
    assert value["replicas"] == 2 and value["sum"] == 3.0


def test_a_tf_config_left_in_sparks_python_workers_is_not_a_ranks(spark):
    """spark-tensorflow-distributor sets TF_CONFIG in Spark's Python worker, which Spark
    reuses: a later job's ranks inherited it and bound its ports, held by the servers that
    live on there ("Could not start gRPC server").  Each rank gets its own job's."""
    import os
    import socket

    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.bind(("0.0.0.0", 0))
    held.listen(1)  # a tf.distribute server of another job
    stale = ('{"cluster": {"worker": ["127.0.0.1:%d", "127.0.0.1:%d"]}, '
             '"task": {"type": "worker", "index": 0}}' % ((held.getsockname()[1],) * 2))
    sc = spark.sparkContext

    def leave(_):
        os.environ["TF_CONFIG"] = stale

    def clear(_):
        os.environ.pop("TF_CONFIG", None)

    try:
        sc.parallelize(range(16), 8).foreach(leave)
        value = _runner(local_mode=False).run(programs.tf_custom_loop)
        assert value["replicas"] == 2 and value["sum"] == 3.0
        assert not any(str(held.getsockname()[1]) in w for w in value["workers"]), value
    finally:
        sc.parallelize(range(16), 8).foreach(clear)
        held.close()
