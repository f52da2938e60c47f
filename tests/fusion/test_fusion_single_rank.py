"""The fusion engine in a world of one (this process): the same checks, no peers.

A single rank skips the coordination collective; everything it submits is
ready at once, so the results must still match numpy exactly.
"""
from __future__ import annotations

import pytest

import _fusion_checks as checks
import collectives
from collectives.fusion import FusionEngine

SINGLE = [checks.allreduce_every_op_and_dtype_matches_numpy,
          checks.bfloat16_buffers_reduce_through_a_dtype_tag,
          checks.scale_factors_and_in_place_results_match_numpy,
          checks.fusion_packs_a_burst_into_few_collectives,
          checks.steady_state_needs_no_negotiation,
          checks.ranks_may_submit_in_different_orders, checks.the_other_kinds_match_numpy,
          checks.scalars_and_empty_tensors_work, checks.wrong_arguments_raise_at_the_call,
          checks.join_lets_ranks_run_uneven_step_counts,
          checks.the_timeline_is_chrome_trace_json_with_every_phase]


@pytest.fixture(scope="module")
def engine():
    comm = collectives.init(collectives.Config(), environ={})
    eng = FusionEngine(comm)
    yield eng, comm
    eng.shutdown()
    comm.close()


@pytest.mark.parametrize("check", SINGLE, ids=lambda c: c.__name__)
def test_one_rank(engine, check, tmp_path):
    eng, comm = engine
    assert comm.size == 1
    if "workdir" in check.__code__.co_varnames:
        check(eng, comm, str(tmp_path))
    else:
        check(eng, comm)


def test_shutdown_then_submit_names_the_cause(engine):
    comm = collectives.init(collectives.Config(), environ={})
    eng = FusionEngine(comm)
    eng.shutdown()
    with pytest.raises(collectives.CollectiveError, match=r"shut down by rank\(s\) \[0\]"):
        eng.submit("after", "allreduce", __import__("numpy").ones(1))
    comm.close()
