"""How the native allreduce op (horovod_spark/tensorflow/lane_op.cc) gets built: once per
host into a fresh cache, under a lock, by ranks started together; and where it cannot be
built (no working compiler), tf.function allreduces keep tf.numpy_function, with a
warning that says why."""
from __future__ import annotations

import logging
import os

import pytest

from _tf_support import TF_ENV, requires_tf
from collectives.launch import run_local

pytestmark = [pytest.mark.tf, requires_tf]


def _steps() -> dict:
    import numpy as np
    import tensorflow as tf

    import horovod_spark.tensorflow as hvd
    from horovod_spark.tensorflow import _basics, _lane_op

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("horovod_spark.tensorflow").addHandler(Keep())
    hvd.init()
    r, n = hvd.rank(), hvd.size()

    @tf.function
    def step(x):
        return hvd.allreduce(x, name="build.step", op=hvd.Sum)

    x0 = tf.constant(np.arange(10, dtype=np.float32))
    kinds = {op.type for op in step.get_concrete_function(x0).graph.get_operations()}
    got = [step(x0 + r + k).numpy() for k in range(6)]
    want = [sum(np.arange(10, dtype=np.float32) + q + k for q in range(n)) for k in range(6)]
    out = {"kinds": sorted(kinds), "equal": all(np.array_equal(g, w) for g, w in zip(got, want)),
           "lane_cycles": _basics.engine().metrics()["lane_cycles"], "warnings": records,
           "error": repr(_lane_op._state.get("error"))}
    hvd.shutdown()
    return out


def test_ranks_build_the_op_once_into_a_fresh_cache(tmp_path):
    env = {**TF_ENV, "HOROVOD_SPARK_CACHE": str(tmp_path)}
    per_rank = run_local(_steps, 2, env=env, timeout=600)
    for res in per_rank:
        assert "HvsLaneAllreduce" in res["kinds"] and res["equal"], res
        assert res["lane_cycles"] >= 3 and res["warnings"] == [], res
    built = [os.path.join(d, f) for d, _, files in os.walk(tmp_path) for f in files
             if f.endswith(".so")]
    assert len(built) == 1, built  # one library, no temporary left behind
    leftovers = [f for _, _, files in os.walk(tmp_path) for f in files if f.endswith(".tmp")]
    assert leftovers == [], leftovers


def test_without_a_compiler_allreduce_keeps_numpy_function(tmp_path):
    env = {**TF_ENV, "HOROVOD_SPARK_CACHE": str(tmp_path), "CXX": "/bin/false"}
    per_rank = run_local(_steps, 2, env=env, timeout=300)
    for res in per_rank:
        assert "HvsLaneAllreduce" not in res["kinds"] and "PyFunc" in res["kinds"], res
        assert res["equal"] and res["lane_cycles"] == 0, res
        assert len(res["warnings"]) == 1, res  # said once, with the reason
        assert "native allreduce op is unavailable" in res["warnings"][0], res
        assert "compiling" in res["warnings"][0] and "failed" in res["warnings"][0], res
