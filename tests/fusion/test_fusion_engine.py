"""The fusion engine on real local ranks: every kind against numpy, fusion, orders,
mismatches, join, stalls, the timeline, shutdown and a lost peer.

One launch per world size runs every check (see _fusion_checks.py); each test
below reads its check's outcome on every rank.  The 3-rank world also runs
with a small fusion threshold, so fused buffers are cut.
"""
from __future__ import annotations


import pytest

import _fusion_checks as checks
from collectives.launch import RankFailed, run_local

SIZES = {2: {"stall_check_time": 1.0},
         3: {"stall_check_time": 1.0, "fusion_threshold": 8192}}


@pytest.fixture(scope="module", params=sorted(SIZES), ids=lambda n: f"{n}ranks")
def results(request, tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp(f"fusion{request.param}"))
    per_rank = run_local(checks.run_all, request.param, args=(SIZES[request.param], workdir),
                         timeout=240)
    return {name: [res[name] for res in per_rank] for name in per_rank[0]}


def _ok(results, check):
    bad = [f"rank {r}:\n{text}" for r, text in enumerate(results[check.__name__]) if text != "ok"]
    assert not bad, "\n".join(bad)


def test_allreduce_of_every_op_and_dtype_matches_numpy(results):
    _ok(results, checks.allreduce_every_op_and_dtype_matches_numpy)


def test_bfloat16_buffers_reduce_with_a_dtype_tag(results):
    _ok(results, checks.bfloat16_buffers_reduce_through_a_dtype_tag)


def test_scale_factors_and_in_place_results_match_numpy(results):
    _ok(results, checks.scale_factors_and_in_place_results_match_numpy)


def test_a_burst_of_tensors_is_fused_into_few_collectives(results):
    _ok(results, checks.fusion_packs_a_burst_into_few_collectives)


def test_adasum_is_an_allreduce_op_fused_per_tensor(results):
    _ok(results, checks.adasum_is_an_allreduce_op_fused_per_tensor)


def test_a_name_resubmitted_with_a_changed_tensor_takes_the_new_one(results):
    _ok(results, checks.a_name_resubmitted_with_a_changed_tensor_takes_the_new_one)


def test_names_seen_before_need_no_negotiation(results):
    _ok(results, checks.steady_state_needs_no_negotiation)


def test_ranks_may_submit_in_different_orders(results):
    _ok(results, checks.ranks_may_submit_in_different_orders)


def test_allgather_broadcast_reducescatter_alltoall_barrier_match_numpy(results):
    _ok(results, checks.the_other_kinds_match_numpy)


def test_scalars_and_empty_tensors_work(results):
    _ok(results, checks.scalars_and_empty_tensors_work)


def test_wrong_arguments_raise_at_the_call(results):
    _ok(results, checks.wrong_arguments_raise_at_the_call)


def test_a_name_already_pending_is_refused(results):
    _ok(results, checks.a_name_already_pending_is_refused)


def test_mismatches_raise_on_every_rank_naming_the_tensor_and_the_ranks(results):
    _ok(results, checks.mismatches_raise_on_every_rank_naming_tensor_and_ranks)


def test_join_lets_ranks_run_uneven_step_counts(results):
    _ok(results, checks.join_lets_ranks_run_uneven_step_counts)


def test_a_stalled_tensor_is_reported_with_the_missing_ranks(results):
    _ok(results, checks.a_stalled_tensor_is_reported_with_the_missing_ranks)


def test_a_stall_past_the_shutdown_time_fails_the_op(results):
    _ok(results, checks.a_stall_past_the_shutdown_time_fails_the_op)  # its own engine, last


def test_the_timeline_is_chrome_trace_json_with_every_phase(results):
    _ok(results, checks.the_timeline_is_chrome_trace_json_with_every_phase)


def test_shutdown_on_one_rank_fails_the_others_ops_naming_it(results):
    _ok(results, checks.shutdown_on_one_rank_fails_the_others_ops_naming_it)


def test_waiting_callers_run_the_cycles_themselves(results):
    _ok(results, checks.waiting_callers_run_the_cycles)


def test_threads_waiting_at_once_share_the_cycles(results):
    _ok(results, checks.threads_waiting_at_once_share_the_cycles)


def test_a_caller_cycle_keeps_the_engines_numpy_error_handling(results):
    _ok(results, checks.a_caller_cycle_keeps_the_engines_numpy_error_handling)


def test_a_caller_cycle_in_inference_mode_finishes_other_ops_as_plain_tensors(results):
    _ok(results, checks.a_caller_cycle_in_inference_mode_finishes_other_ops_as_plain_tensors)


def test_a_lazy_op_nobody_waits_for_still_finishes(results):
    _ok(results, checks.a_lazy_op_nobody_waits_for_still_finishes)


def test_a_wait_with_a_timeout_times_out_then_the_op_finishes(results):
    _ok(results, checks.a_wait_with_a_timeout_times_out_then_the_op_finishes)


@pytest.mark.parametrize("timeout", [None, checks.WAIT], ids=["caller-driven", "engine-thread"])
def test_a_lost_peer_fails_pending_ops_with_the_cause(tmp_path, timeout):
    with pytest.raises(RankFailed) as info:
        run_local(checks.lose_a_peer, 2, args=(str(tmp_path), timeout), timeout=120)
    assert info.value.rank == 1
    text = (tmp_path / "lost_peer.txt").read_text()
    first, later = text.splitlines()[0], text.splitlines()[-1]
    assert "lp.x" in first and "rank 0/2" in first and "failure" in first, text
    assert "shut down" not in first, text
    assert "lp.y" in later and "failure" in later, text


@pytest.mark.parametrize("inside_cycle", [True, False], ids=["inside-its-cycle", "at-any-point"])
def test_ctrl_c_reaches_a_caller_that_runs_the_cycles(tmp_path, inside_cycle):
    got = run_local(checks.interrupt_a_waiting_caller, 2, args=(str(tmp_path), inside_cycle),
                    timeout=60)[0]
    assert got.startswith("interrupted after"), got
    assert float(got.split()[2]) < 3.0, got  # at the signal, not when rank 1 moves on
    if inside_cycle:  # the ranks no longer agree on where they are: the engine says why
        assert "ki.y" in got and "KeyboardInterrupt" in got and "rank 0/2" in got, got


def test_a_collective_in_a_signal_handler_inside_a_callers_cycle_fails_clearly(tmp_path):
    got = run_local(checks.a_signal_handler_waits_inside_the_callers_cycle, 2,
                    args=(str(tmp_path),), timeout=60)[0]
    assert got.startswith("after ") and float(got.split()[1]) < 3.0, got  # no deadlock
    assert "sh.barrier" in got and "signal handler" in got and "set a flag" in got, got
