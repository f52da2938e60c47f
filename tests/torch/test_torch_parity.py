"""horovod_spark.torch computes what Horovod's torch API computes (2 and 3 real ranks).

One launch per world size runs every check of _torch_parity_checks.py.
"""
from __future__ import annotations

import pytest

import _torch_parity_checks as checks
from _torch_support import assert_ok
from collectives.launch import run_local

ENV = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def results(request):
    per_rank = run_local(checks.run_all, request.param, env=ENV, timeout=180)
    return {name: [res[name] for res in per_rank] for name in per_rank[0]}


@pytest.mark.parametrize("check", [c.__name__ for c in checks.CHECKS])
def test_torch_matches_horovod(results, check):
    assert_ok(results[check])
