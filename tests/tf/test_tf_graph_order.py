"""Independent collectives in one graph never deadlock (2 real local ranks, 2 inter-op
threads each, 16 ops, repeated): in a tf.function TensorFlow runs them in program order; in a
tf.compat.v1 graph each runs as an asynchronous op, whatever order each rank's threads
pick (before, with the ops made in opposite orders on the two ranks, such a graph
deadlocked: every inter-op thread blocked in a collective the other rank had not
reached).  A hang fails the launch's timeout."""
from __future__ import annotations

import pytest

import _tf_graph_order_checks as checks
from _tf_support import TF_ENV, assert_ok, requires_tf

pytestmark = [pytest.mark.tf, requires_tf]


@pytest.fixture(scope="module")
def results():
    from collectives.launch import run_local

    env = {k: v for k, v in TF_ENV.items() if k != "TF_NUM_INTEROP_THREADS"}
    per_rank = run_local(checks.run_all, 2, env=env, timeout=150)
    return {name: [res[name] for res in per_rank] for name in per_rank[0]}


@pytest.mark.parametrize("check", list(checks.CHECKS))
def test_independent_collectives_in_one_graph(results, check):
    assert_ok(results, check)
