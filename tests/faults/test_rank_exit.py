"""What a rank leaves behind when its function ends: the value, the error, the timeline.

An exception whose __str__ raises is still reported by type; under
HorovodRunner only rank 0's value is pickled, so an unpicklable value on rank 1
cannot fail the job; a rank that returns without hvd.shutdown() still closes
its timeline; the job's secret does not reach the function's subprocesses; a rank that
returns without init() is the one blamed, at once, as such.
"""
from __future__ import annotations

import json

import pytest

import _default_ranks as ranks
import _fault_kit as kit


@pytest.mark.slow
def test_an_exception_whose_str_raises_is_reported_by_its_type_and_args(fault):
    out = kit.run_local_job(ranks.raises_unprintable, 2, env=fault.env(), outdir=fault.outdir,
                            timeout=60.0)
    assert out.error is not None, out.value
    assert out.error.error_type == "_BadStr", str(out.error)
    assert "__str__ raised RuntimeError" in out.error.message, out.error.message
    assert "('disk full', 7)" in out.error.message, out.error.message


@pytest.mark.spark
@pytest.mark.slow
def test_on_spark_an_exception_whose_str_raises_is_reported_by_its_type(spark, fault):
    out = kit.run_spark_job(ranks.raises_unprintable, 2, env=fault.env(), outdir=fault.outdir)
    assert out.error is not None, out.value
    assert out.error.error_type == "_BadStr", str(out.error)
    assert "('disk full', 7)" in out.error.error_message, str(out.error)


@pytest.mark.spark
@pytest.mark.slow
def test_horovod_runner_never_pickles_the_values_of_ranks_other_than_0(spark):
    from horovod_spark import HorovodRunner

    assert HorovodRunner(np=2, verbose=0).run(ranks.unpicklable_on_rank1) == "rank 0's value"


@pytest.mark.slow
def test_a_rank_that_returns_without_shutdown_leaves_a_complete_timeline(fault, tmp_path):
    path = str(tmp_path / "timeline.json")
    out = kit.run_local_job(ranks.timeline_without_shutdown, 2, args=(path,), env=fault.env(),
                            outdir=fault.outdir, timeout=60.0)
    assert out.error is None and out.value == [0, 1], out.error
    with open(path) as f:
        events = json.load(f)
    assert sum(1 for e in events if e.get("name") == "ALLREDUCE") == 5, events


@pytest.mark.slow
def test_the_job_secret_does_not_reach_the_functions_subprocesses(fault):
    out = kit.run_local_job(ranks.secret_seen_by_a_subprocess, 2, env=fault.env(),
                            outdir=fault.outdir, timeout=60.0)
    assert out.error is None, out.error
    assert out.value == [("None", False)] * 2, out.value


def _blames_the_rank_that_skipped_init(out):
    assert out.error is not None, out.value
    assert out.error.rank == 1, str(out.error)  # the rank that returned, not the one waiting
    text = str(out.error)
    assert "returned from its function and exited without calling init()" in text, text
    assert "rank 1 returned from its function and exited 0 while rank 0 waited for it" in text
    assert "swapped out" not in text
    assert out.raised_at - out.started_at < 30, "the waiting rank waited for its timeout"


def test_a_rank_that_returns_without_init_is_blamed_as_such_at_once(fault):
    out = kit.run_local_job(ranks.rank_1_skips_init, 2, env=fault.env(), outdir=fault.outdir,
                            timeout=90.0)
    _blames_the_rank_that_skipped_init(out)


@pytest.mark.spark
@pytest.mark.slow
def test_on_spark_a_rank_that_returns_without_init_is_blamed_as_such_at_once(spark, fault):
    out = kit.run_spark_job(ranks.rank_1_skips_init, 2, env=fault.env(), outdir=fault.outdir)
    _blames_the_rank_that_skipped_init(out)
