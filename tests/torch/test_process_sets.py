"""Process sets in horovod_spark.torch (real ranks): ops on subsets over shared memory,
TCP and mixed placements, concurrency, errors, dynamic add/remove, DistributedOptimizer.

One launch per placement runs every check of _process_set_checks.py.
"""
from __future__ import annotations

import pytest

import _process_set_checks as checks
from _torch_support import assert_ok
from collectives.launch import run_local

ENV = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
PLACEMENTS = {
    # name: (ranks, extra environment, hosts, how the sets are registered)
    "shm-3": (3, {"HOROVOD_DYNAMIC_PROCESS_SETS": "1"}, None, "env"),
    "tcp-3": (3, {"HOROVOD_SPARK_FORCE_TCP": "1"}, None, "static"),
    "mixed-aabb": (4, {}, ["a", "a", "b", "b"], "dynamic"),
}


@pytest.fixture(scope="module", params=sorted(PLACEMENTS))
def results(request):
    np_, env, hosts, mode = PLACEMENTS[request.param]
    per_rank = run_local(checks.run_all, np_, args=(mode,), env={**ENV, **env}, hosts=hosts,
                         timeout=120)
    return {name: [res[name] for res in per_rank] for name in per_rank[0]}


@pytest.mark.parametrize("check", [c.__name__ for c in checks.CHECKS])
def test_process_sets(results, check):
    assert_ok(results[check])
