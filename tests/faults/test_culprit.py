"""On Spark the culprit is blamed, not the reporter.

A rank frozen in the middle of training (SIGSTOP) says nothing; its peer times
out naming it.  The driver's error is about the frozen rank: JobFailedError.rank
is the rank that stopped, and the message still says what its peer saw.
"""
from __future__ import annotations

import pytest

import _fault_kit as kit
import _fault_ranks as ranks

OP_TIMEOUT = 3.0


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_on_spark_a_sigstopped_rank_is_the_one_the_driver_blames(spark, fault, transport):
    out = kit.run_spark_job(ranks.stall_in_allreduce, 2, args=(fault.outdir, 1, 3, True),
                            env=fault.env(tcp=transport == "tcp", timeout=OP_TIMEOUT),
                            outdir=fault.outdir)
    assert out.error is not None, out.value
    assert out.error.rank == 1, str(out.error)
    assert "peer rank 1" in str(out.error), str(out.error)
    seconds, left = kit.wait_gone(fault.tag, timeout=15.0)
    assert not left, left
