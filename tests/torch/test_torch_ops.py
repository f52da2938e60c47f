"""horovod_spark.torch's ops on 2 and 3 real local ranks, against numpy.

One launch per world size runs every check of _torch_ops_checks.py; each test
below reads its check's outcome on every rank.
"""
from __future__ import annotations

import pytest

import _torch_ops_checks as checks
from _torch_support import assert_ok
from collectives.launch import run_local

ENV = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def results(request):
    per_rank = run_local(checks.run_all, request.param, env=ENV, timeout=240)
    return {name: [res[name] for res in per_rank] for name in per_rank[0]}


def test_rank_before_init_is_a_clear_error(results):
    assert_ok(results["rank_before_init_is_a_clear_error"])


@pytest.mark.parametrize("check", [c.__name__ for c in checks.CHECKS])
def test_torch_op(results, check):
    assert_ok(results[check])
