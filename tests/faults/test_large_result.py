"""A large result comes home on the job's own channel, not through Spark's collect().

Through collect() a rank-0 result of a few hundred MB filled the driver JVM's
heap: run() hung, or the JVM died.  A task now puts its result in the driver's
job store (authenticated, in the driver's Python process) and its row only
says so.  One run at 300 MB proves the path (memory is shared on this machine).
"""
from __future__ import annotations

import pytest

import _default_ranks as ranks

MIB = 300


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(280)
def test_a_300_mb_result_of_rank_0_reaches_the_driver_intact(spark):
    from horovod_spark import HorovodRunner

    value = HorovodRunner(np=2, verbose=0).run(ranks.large_result, mib=MIB)
    assert isinstance(value, bytes) and len(value) == MIB << 20
    assert all(value[i << 20] == i % 251 for i in range(MIB))
    del value
    assert spark.range(3).count() == 3  # the session (and its JVM) still works
