"""A stall under the default settings: a named error on every rank, never a hang.

Ranks that submit one name as different kinds (allreduce on rank 0, allgather
on rank 1) wait for each other for ever unless the stall check fails them.
The error names the tensor, what every rank submitted instead and the ranks
missing; the stall warnings reach the driver whatever `driver_log_verbosity`.
"""
from __future__ import annotations

import pytest

import _default_ranks as ranks
import _fault_kit as kit
from collectives import Config

CHECK, SHUTDOWN = 1.0, 3.0


def test_the_default_stall_shutdown_is_bounded():
    assert 0 < Config.create(env={}).stall_shutdown_time <= 600


@pytest.mark.slow
def test_ranks_that_submit_one_name_as_different_kinds_fail_on_every_rank_saying_what_each_sent(
        fault):
    env = fault.env(HOROVOD_STALL_CHECK_TIME_SECONDS=CHECK)  # the shutdown time: the default's
    env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] = str(SHUTDOWN)
    out = kit.run_local_job(ranks.kinds_differ, 2, args=(fault.outdir,), env=env,
                            outdir=fault.outdir, timeout=60.0)
    assert out.error is not None, out.value
    errors = out.notes("error")
    assert sorted(errors) == [0, 1], errors
    mine, theirs = {0: "allreduce 'allreduce.x'", 1: "allgather 'allgather.x'"}, \
        {0: "rank 1 waits in allgather 'allgather.x' float32", 1: "rank 0 waits in allreduce "
                                                               "'allreduce.x' float32[4]"}
    for r, err in errors.items():
        assert err["type"] == "CollectiveTimeout", err
        assert err["message"].startswith(mine[r]), err["message"]
        assert theirs[r] in err["message"], err["message"]
        assert f"not yet by ranks [{1 - r}]" in err["message"], err["message"]
        assert "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS" in err["message"], err["message"]
    seconds, left = kit.wait_gone(fault.tag, timeout=10.0)
    assert not left, left


@pytest.mark.spark
@pytest.mark.slow
def test_stall_warnings_reach_the_driver_under_the_default_verbosity(spark, fault, capsys):
    from horovod_spark import HorovodRunner, JobFailedError

    with pytest.raises(JobFailedError) as info:
        HorovodRunner(np=2, verbose=0).run(ranks.kinds_differ, outdir=fault.outdir,
                                           check_s=CHECK, shutdown_s=SHUTDOWN)
    shown = capsys.readouterr()
    lines = [ln for ln in (shown.out + shown.err).splitlines() if "stalled for" in ln]
    assert any(ln.startswith("[0]<stdout>:allreduce 'allreduce.x'") and
               "rank 1 waits in allgather 'allgather.x'" in ln for ln in lines), shown
    assert "rank 1 waits in allgather 'allgather.x'" in str(info.value) or \
        "rank 0 waits in allreduce 'allreduce.x'" in str(info.value), str(info.value)
