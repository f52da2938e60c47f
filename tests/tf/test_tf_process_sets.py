"""Process sets in horovod_spark.tensorflow and Keras (3 real ranks on hosts a, a, b; one
launch runs every check of _tf_process_set_checks.py)."""
from __future__ import annotations

import pytest

import _tf_process_set_checks as checks
from _tf_support import TF_ENV, assert_ok, requires_tf
from collectives.launch import run_local

pytestmark = [pytest.mark.tf, requires_tf]


@pytest.fixture(scope="module")
def results():
    per_rank = run_local(checks.run_all, 3, env=TF_ENV, hosts=["a", "a", "b"], timeout=240)
    return {name: [res[name] for res in per_rank] for name in per_rank[0]}


@pytest.mark.parametrize("check", list(checks.CHECKS))
def test_tensorflow_process_sets(results, check):
    assert_ok(results, check)
