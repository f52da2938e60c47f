"""Ranks that do not finish together: told what happened, fast, never a hang.

A rank that runs one more step than another waits in a collective the other
never joins: once that other returned from the function, the waiting rank is
told so.  A rank frozen after its last collective (SIGSTOP) never returns: once
any rank has returned, the others have a finish grace
(HOROVOD_SPARK_FINISH_GRACE_SECONDS), then the job fails naming the rank that
did not return.  A whole-job `timeout=` bounds everything else.
"""
from __future__ import annotations

import pytest

import _default_ranks as ranks
import _fault_kit as kit

GRACE = 2.0
UNEVEN = ("rank 0 returned from the function (or called hvd.shutdown()) while this rank waits "
          "in this op; every rank must run the same number of steps, or use hvd.join()")


def _gone(fault) -> None:
    seconds, left = kit.wait_gone(fault.tag, timeout=15.0)
    assert not left, f"rank processes left {seconds:.1f} s after the job: {left}"


@pytest.mark.slow
def test_a_rank_that_runs_one_more_step_is_told_that_rank_0_returned(fault):
    out = kit.run_local_job(ranks.uneven_steps, 2, args=(fault.outdir,), env=fault.env(),
                            outdir=fault.outdir, timeout=60.0)
    assert out.error is not None, out.value
    assert out.error.rank == 1, str(out.error)
    assert "allreduce 'allreduce.x' float32[4] on rank 1/2" in out.error.message, out.error.message
    assert UNEVEN in out.error.message, out.error.message
    _gone(fault)


@pytest.mark.slow
def test_a_rank_frozen_after_its_last_collective_fails_the_job_after_the_finish_grace(fault):
    env = fault.env(HOROVOD_SPARK_FINISH_GRACE_SECONDS=GRACE)
    out = kit.run_local_job(ranks.frozen_after_last_op, 2, args=(fault.outdir,), env=env,
                            outdir=fault.outdir, timeout=60.0)
    assert out.error is not None, out.value
    assert (out.error.rank, out.error.error_type) == (1, "RankDidNotFinish"), str(out.error)
    assert out.error.message.startswith(f"rank 0 returned from the function {GRACE:g} s ago and "
                                        "rank 1 has not"), out.error.message
    _gone(fault)


@pytest.mark.spark
@pytest.mark.slow
def test_on_spark_a_rank_that_runs_one_more_step_is_told_that_rank_0_returned(spark, fault):
    out = kit.run_spark_job(ranks.uneven_steps, 2, args=(fault.outdir,), env=fault.env(),
                            outdir=fault.outdir, timeout=120.0)
    assert out.error is not None, out.value
    assert out.error.rank == 1 and UNEVEN in out.error.error_message, str(out.error)
    _gone(fault)


@pytest.mark.spark
@pytest.mark.slow
def test_on_spark_a_frozen_rank_is_named_after_the_finish_grace(spark, fault):
    env = fault.env(HOROVOD_SPARK_FINISH_GRACE_SECONDS=GRACE)
    out = kit.run_spark_job(ranks.frozen_after_last_op, 2, args=(fault.outdir,), env=env,
                            outdir=fault.outdir, timeout=120.0)
    assert out.error is not None, out.value
    assert (out.error.rank, out.error.error_type) == (1, "RankDidNotFinish"), str(out.error)
    _gone(fault)


@pytest.mark.spark
@pytest.mark.slow
def test_the_whole_job_timeout_ends_a_job_that_runs_past_it(spark, fault):
    out = kit.run_spark_job(ranks.sleeps, 2, args=(fault.outdir, 120.0), env=fault.env(),
                            outdir=fault.outdir, timeout=3.0)
    assert out.error is not None, out.value
    assert out.error.error_type == "JobTimeout", str(out.error)
    assert "timeout of 3 s" in out.error.error_message, str(out.error)
    _gone(fault)


@pytest.mark.spark
@pytest.mark.slow
def test_horovod_runner_takes_a_whole_job_timeout(spark, fault):
    from horovod_spark import HorovodRunner, JobFailedError

    with pytest.raises(JobFailedError, match="JobTimeout"):
        HorovodRunner(np=2, verbose=0, timeout=3.0).run(ranks.sleeps, outdir=fault.outdir,
                                                          seconds=120.0)
    for bad in (0, -1, "5", True):
        with pytest.raises(ValueError, match="timeout must be"):
            HorovodRunner(np=2, timeout=bad)
