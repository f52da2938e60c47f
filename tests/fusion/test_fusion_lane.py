"""The fusion engine's lane (collectives/fusion/lane.py, native/src/lane) on real
local ranks: an armed op runs in C++ and pairs with Python cycles on other ranks;
joins, new names and a lost peer go through the engine as they would without it."""
from __future__ import annotations

import json

import pytest

import _lane_checks as checks
from collectives.launch import RankFailed, run_local


@pytest.mark.parametrize("plan", ["lane", "mixed"])
@pytest.mark.parametrize("size", [2, 3])
def test_an_armed_op_runs_in_the_lane_and_matches_numpy(plan, size):
    per_rank = run_local(checks.steady_state, size, args=(plan,), timeout=180)
    for r, res in enumerate(per_rank):
        assert res["bad"] == [], (r, res["bad"][:3])
        # the first run of each name arms its slot; after that the lane runs most of them
        assert res["codes"].count(checks.DONE) >= len(res["codes"]) // 2, (r, res["codes"])
        assert res["lane_cycles"] == res["codes"].count(checks.DONE), (r, res)


def test_the_lane_pairs_with_python_over_tcp():
    per_rank = run_local(checks.steady_state, 3, args=("mixed", 40), timeout=180,
                         env={"HOROVOD_SPARK_FORCE_TCP": "1"})
    for r, res in enumerate(per_rank):
        assert res["bad"] == [] and res["lane_cycles"] > 0, (r, res["bad"][:3], res["lane_cycles"])


def test_python_only_ranks_agree_with_the_lane():
    per_rank = run_local(checks.steady_state, 2, args=("python", 20), timeout=120)
    assert all(res["bad"] == [] and res["lane_cycles"] == 0 for res in per_rank), per_rank


@pytest.mark.parametrize("size", [2, 3])
def test_a_join_hands_the_lanes_cycle_to_the_engine(size):
    per_rank = run_local(checks.a_join_hands_the_cycle_over, size, timeout=120)
    for res in per_rank[:-1]:
        assert res["code"] == checks._native.LANE_CODES["handover"], res
        assert res["equal"] and res["handovers"] >= 1, res
    assert len({res["last_joined"] for res in per_rank}) == 1, per_rank


def test_a_lost_peer_fails_the_lane_with_the_cause(tmp_path):
    with pytest.raises(RankFailed) as info:
        run_local(checks.a_lost_peer_fails_the_lane_fast, 2, args=(str(tmp_path),), timeout=120)
    assert info.value.rank == 1
    got = json.loads((tmp_path / "lost.json").read_text())
    assert "rank 0/2" in got["first"] and "shut down" not in got["first"], got
    assert got["first"].startswith(("PeerLostError", "CollectiveTimeout")), got
    assert "after" in got["later"] and "failure" in got["later"], got


@pytest.mark.parametrize("size", [2, 3])
def test_a_new_signature_beside_the_lane_fails_every_rank_as_a_mismatch(size):
    per_rank = run_local(checks.a_new_signature_beside_the_lane_is_a_mismatch, size, timeout=120)
    for r, res in enumerate(per_rank):
        assert res["error"].startswith("MismatchError") and "'g'" in res["error"], (r, res)
    assert any(res["handovers"] >= 1 for r, res in enumerate(per_rank) if r != 1), per_rank


def test_new_names_leave_the_other_armed_slots_in_the_lane():
    steps = 20
    for res in run_local(checks.new_names_leave_other_slots_armed, 2, args=(steps,), timeout=120):
        assert res["bad"] == [], res
        codes = res["codes"]
        # first run arms; the step with a new shape evicts the name's bit (a fallback), and
        # the step after it runs the old shape again, which must re-arm too; every other
        # step stays in the lane although a new name negotiated just before it
        assert codes[0] != checks.DONE and codes[steps // 2] != checks.DONE, codes
        rest = [c for i, c in enumerate(codes) if i not in (0, steps // 2, steps // 2 + 1)]
        assert rest == [checks.DONE] * len(rest), codes
