"""A job killed between the creation of its shared memory and the last attach leaves none.

Local rank 0 creates the host's segment and unlinks it once every local rank
has attached; killed in between, with the rest of the job, nobody of the job
can.  The process that started the rank (the local launcher, the Spark task)
removes what its killed child created.  Each trial is one job; a leak in any
trial fails the test.
"""
from __future__ import annotations

import pytest

import _default_ranks as ranks
import _fault_kit as kit

TRIALS = 5


def _trial(out, fault) -> list:
    assert out.error is not None, out.value
    killed = out.notes("killed")
    assert killed and killed[0]["shm"], f"rank 0 was not killed holding its segment: {killed}"
    seconds, left = kit.wait_gone(fault.tag, timeout=15.0)
    assert not left, left
    return kit.shm_segments(out.pids())


@pytest.mark.slow
def test_a_job_killed_while_its_shared_memory_waits_for_attachers_leaves_no_segment(tmp_path):
    leaks = []
    for trial in range(TRIALS):
        fault = kit.FaultJob(tmp_path / str(trial))
        try:
            out = kit.run_local_job(ranks.job_killed_while_sharing_memory, 3,
                                    args=(fault.outdir,), env=fault.env(), outdir=fault.outdir,
                                    timeout=60.0)
            leaks += _trial(out, fault)
        finally:
            fault.cleanup()
    assert not leaks, f"{len(leaks)} segments left in {TRIALS} trials: {leaks}"


@pytest.mark.spark
@pytest.mark.slow
def test_on_spark_a_job_killed_while_its_shared_memory_waits_leaves_no_segment(spark, fault):
    out = kit.run_spark_job(ranks.job_killed_while_sharing_memory, 2, args=(fault.outdir,),
                            env=fault.env(), outdir=fault.outdir)
    assert not _trial(out, fault)
