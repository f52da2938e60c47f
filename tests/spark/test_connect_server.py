"""The test suite's Spark Connect server (tests/connect_server.py) is a real one."""
from __future__ import annotations

import pytest

from _spark_support import by_value

by_value(__name__)
pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]


def _partition_and_address(batches):
    import pyarrow as pa
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    for _ in batches:
        pass
    yield pa.RecordBatch.from_pydict({"p": [ctx.partitionId()],
                                      "n": [len(ctx.getTaskInfos())]})


def test_the_client_has_no_spark_context_and_runs_a_barrier_stage(connect_server):
    spark = connect_server.session()
    assert type(spark).__module__ == "pyspark.sql.connect.session"
    with pytest.raises(Exception, match="sparkContext"):
        spark.sparkContext
    assert spark.conf.get("spark.master") == "local[2]"
    rows = spark.range(2, numPartitions=2).mapInArrow(
        _partition_and_address, "p long, n long", barrier=True).collect()
    assert sorted((r.p, r.n) for r in rows) == [(0, 2), (1, 2)]
