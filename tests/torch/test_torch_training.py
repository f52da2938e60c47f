"""DistributedOptimizer on two real local ranks equals single-process training.

One launch runs every check of _torch_train_checks.py (with HOROVOD_TIMELINE
set, so the timeline of real training is checked too); each test below reads
its check's outcome on every rank.
"""
from __future__ import annotations

import pytest

import _torch_train_checks as checks
from _torch_support import assert_ok
from collectives.launch import run_local


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    timeline = str(tmp_path_factory.mktemp("timeline") / "timeline.json")
    env = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "HOROVOD_TIMELINE": timeline}
    per_rank = run_local(checks.run_all, 2, args=(timeline,), env=env, timeout=240)
    return {name: [res[name] for res in per_rank] for name in per_rank[0]}


@pytest.mark.parametrize("check", [c.__name__ for c in checks.CHECKS])
def test_distributed_optimizer(results, check):
    assert_ok(results[check])


def test_the_timeline_of_training_records_every_gradient(results):
    assert_ok(results["the_timeline_records_every_gradient"])
