"""op=hvd.Adasum in horovod_spark.torch: allreduce (every float dtype, in place,
grouped) and DistributedOptimizer(op=Adasum), bit for bit against a numpy
reference of the same tree, on 4 real ranks; refused, saying why, on 3.

One launch per world size runs every check of _torch_adasum_checks.py.
"""
from __future__ import annotations

import pytest

import _torch_adasum_checks as checks
from _torch_support import assert_ok
from collectives.launch import run_local

ENV = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture(scope="module")
def results():
    per_rank = run_local(checks.run_all, 4, env=ENV, timeout=180)
    return {name: [res[name] for res in per_rank] for name in per_rank[0]}


@pytest.mark.parametrize("check", [c.__name__ for c in checks.CHECKS])
def test_adasum_matches_the_reference_tree(results, check):
    assert_ok(results[check])


def test_adasum_off_a_power_of_two_world_is_refused_saying_why():
    per_rank = run_local(checks.run_all, 3, env=ENV, timeout=120)
    assert [res["refused"] for res in per_rank] == ["ok"] * 3


def test_the_tree_pairs_neighbours_first():
    """Which vectors meet first matters: (v0+v1)+(v2+v3), not (v0+v2)+(v1+v3)."""
    import numpy as np

    from collectives.adasum import combine, tree

    rng = np.random.default_rng(7)
    rows = rng.standard_normal((4, 9))
    want = combine(combine(rows[0], rows[1]), combine(rows[2], rows[3]))
    assert np.array_equal(tree(rows), want)
    assert not np.allclose(tree(rows[[0, 2, 1, 3]]), want)
    assert np.array_equal(tree(rows, [(0, 4), (4, 9)]),
                          np.concatenate([tree(rows[:, :4]), tree(rows[:, 4:])]))
