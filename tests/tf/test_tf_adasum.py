"""op=hvd.Adasum in horovod_spark.tensorflow and keras on 2 real local ranks (its
refusal off a power-of-two world is in test_tf_ops.py's 3-rank run)."""
from __future__ import annotations

import pytest

import _tf_adasum_checks as checks
from _tf_support import assert_ok, requires_tf, run_checks

pytestmark = [pytest.mark.tf, requires_tf]


@pytest.fixture(scope="module")
def results():
    return run_checks(checks.run_all, 2)


@pytest.mark.parametrize("check", list(checks.CHECKS))
def test_tensorflow_adasum_matches_the_reference_tree(results, check):
    assert_ok(results, check)
