"""horovod_spark.torch's blocking named allreduces through the engine's C++ lane
(horovod_spark/torch/_lane.py) on real local ranks: exact results, the lane beside
async ops, joins, mismatches and a rank with the lane switched off, and a lost peer
named fast under default settings."""
from __future__ import annotations

import json

import pytest

import _torch_lane_checks as checks
from _torch_support import assert_ok
from collectives.launch import RankFailed, run_local

ENV = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture(scope="module", params=[(2, ()), (3, ()), (3, (1,))],
                ids=["2ranks", "3ranks", "3ranks-rank1-lane-off"])
def results(request):
    size, off = request.param
    per_rank = run_local(checks.run_all, size, args=(off,), env=ENV, timeout=240)
    return {"off": off, "per_rank": per_rank}


@pytest.mark.parametrize("check", [c.__name__ for c in checks.CHECKS])
def test_torch_lane(results, check):
    assert_ok([res[check] for res in results["per_rank"]])


def test_the_lane_ran_only_where_it_is_on(results):
    for r, res in enumerate(results["per_rank"]):
        if r in results["off"]:
            assert res["lane_cycles"] == 0, (r, res["lane_cycles"])
        else:
            assert res["lane_cycles"] > 50, (r, res["lane_cycles"])


@pytest.mark.parametrize("queued", [False, True], ids=["blocking", "async"])
def test_a_lost_peer_fails_the_blocking_op_fast(tmp_path, queued):
    with pytest.raises(RankFailed) as info:
        run_local(checks.a_lost_peer_fails_the_blocking_op, 2, args=(str(tmp_path), queued),
                  env=ENV, timeout=120)
    assert info.value.rank == 1
    got = json.loads((tmp_path / "lost.json").read_text())
    # rank 0, waiting in the lane, names the rank that went (about 20 ms here, not a timeout)
    assert got["first"].startswith("PeerLostError") and "peer rank 1" in got["first"], got
    assert "'allreduce.lost'" in got["first"] and "on rank 0/2" in got["first"], got
    assert got["later"].startswith("PeerLostError") and "engine stopped" in got["later"], got
    if queued:  # the op queued beside the one that failed fails with the same cause
        assert got["later"].endswith("second: PeerLostError"), got
