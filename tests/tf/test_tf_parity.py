"""horovod_spark.tensorflow computes what Horovod's TensorFlow API computes
(2 and 3 real local ranks; one launch per world size runs every check)."""
from __future__ import annotations

import pytest

import _tf_parity_checks as checks
from _tf_support import assert_ok, requires_tf, run_checks

pytestmark = [pytest.mark.tf, requires_tf]


@pytest.fixture(scope="module", params=[2, 3], ids=["np2", "np3"])
def results(request):
    return run_checks(checks.run_all, request.param)


@pytest.mark.parametrize("check", list(checks.CHECKS))
def test_tensorflow_matches_horovod(results, check):
    assert_ok(results, check)
