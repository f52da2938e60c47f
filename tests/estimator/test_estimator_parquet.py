"""fit_on_parquet's direct read: the tasks read their row groups with pyarrow (_parquet).

What a task reads must be what Spark's read and ``data.prepare`` hand it: the
same rows, columns and values (dense and sparse Vectors, arrays, booleans,
integer and double scalars, nulls).  Compared here against Spark itself.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from horovod_spark.estimator import _parquet
from horovod_spark.estimator.data import column_specs, prepare

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def written(spark, tmp_path_factory):
    from pyspark.ml.linalg import Vectors, VectorUDT
    from pyspark.sql.types import (ArrayType, BooleanType, DoubleType, IntegerType, LongType,
                                   StructField, StructType)

    rng = np.random.default_rng(0)
    rows = []
    for i in range(1500):
        if i % 3 == 0:
            vec = Vectors.sparse(6, [1, 4], [float(i), -1.5])
        else:
            vec = Vectors.dense(rng.random(6))
        rows.append((vec, float(i % 7) if i != 11 else None, i % 3, [float(i), 0.5, -1.0],
                     bool(i % 2), i))
    schema = StructType([StructField("v", VectorUDT()), StructField("y", DoubleType()),
                         StructField("k", LongType()), StructField("a", ArrayType(DoubleType())),
                         StructField("b", BooleanType()), StructField("i", IntegerType())])
    path = str(tmp_path_factory.mktemp("pq") / "data.parquet")
    # small row groups, three files: the plan has row groups to share out
    (spark.createDataFrame(rows, schema).repartition(3).write
     .option("parquet.block.size", 8192).parquet(path))
    return path


def _rows(table):
    cols = [table.column(n).to_pylist() for n in table.column_names]
    return sorted(zip(*cols), key=repr)


@pytest.mark.parametrize("num_proc", [1, 2, 3])
def test_the_shares_hold_what_spark_prepares_for_the_ranks(spark, written, num_proc):
    df = spark.read.parquet(written)
    specs = column_specs(df.schema, ["v", "a", "b", "i"], ["y", "k"])
    plan = _parquet.plan(written, specs, num_proc)
    assert plan is not None and len(plan[1]) == num_proc
    shares = [pa.Table.from_batches(list(_parquet.read_share(plan[0], share, specs)))
              for share in plan[1]]
    assert all(t.num_rows > 0 for t in shares)
    direct = pa.concat_tables([t.cast(shares[0].schema) for t in shares])
    jvm = pa.Table.from_batches(prepare(df, specs)._collect_as_arrow())
    assert direct.column_names == jvm.column_names
    for name in direct.column_names:  # the types the spill takes: float32 lists, etc.
        assert str(direct.schema.field(name).type).split("<")[0] == \
            str(jvm.schema.field(name).type).split("<")[0], name
    assert _rows(direct) == _rows(jvm)
    assert direct.column("y").null_count == 1  # the spill names it, as on the JVM path


def test_the_dry_run_sample_is_read_on_the_driver_as_spark_prepares_it(spark, written):
    """fit_on_parquet's pre-fit checks take their sample rows from the planned read (no
    Spark job): the first rows of rank 0's share, as the JVM path prepares those rows."""
    from horovod_spark.estimator.data import batch_from_table

    df = spark.read.parquet(written)
    specs = column_specs(df.schema, ["v", "a"], ["y", "k"])
    plan = _parquet.plan(written, specs, 2)
    got = _parquet.sample(plan, specs, 16)
    first = next(iter(plan[1][0]))[0]  # rank 0's first file: Spark's prepared rows of it
    want = batch_from_table(pa.Table.from_batches(
        prepare(spark.read.parquet(first), specs)._collect_as_arrow()).slice(0, 16), specs)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_the_sample_of_a_read_without_rows_is_none(tmp_path):
    import pyarrow.parquet as pq

    path = tmp_path / "empty.parquet"
    path.mkdir()
    pq.write_table(pa.table({"x": pa.array([], pa.float64()), "y": pa.array([], pa.float64())}),
                   str(path / "part-0.parquet"))
    specs = column_specs(_spark_schema_of_arrow(), ["x"], ["y"])
    piece = (str(path / "part-0.parquet"), (0,))  # (file, row groups)
    assert _parquet.sample((str(path), ((piece,),)), specs, 8) is None  # one rank, one piece


def _spark_schema_of_arrow():
    from pyspark.sql.types import DoubleType, StructField, StructType

    return StructType([StructField("x", DoubleType()), StructField("y", DoubleType())])


def test_a_null_vector_stays_null_and_sparse_ones_scatter():
    """(Spark's own vector_to_array refuses a null Vector; the direct read keeps it null,
    and the spill then names the column.)"""
    struct = pa.StructArray.from_arrays(
        [pa.array([1, 0, None, 0], pa.int8()), pa.array([None, 4, None, 3], pa.int32()),
         pa.array([None, [0, 3], None, []], pa.list_(pa.int32())),
         pa.array([[1.0, 2.0, 3.0], [5.0, 6.0], None, []], pa.list_(pa.float64()))],
        names=["type", "size", "indices", "values"],
        mask=pa.array([False, False, True, False]))
    got = _parquet._dense(struct.slice(0)).to_pylist()
    assert got == [[1.0, 2.0, 3.0], [5.0, 0.0, 0.0, 6.0], None, [0.0, 0.0, 0.0]]
    assert _parquet._dense(struct.slice(1, 2)).to_pylist() == [[5.0, 0.0, 0.0, 6.0], None]
    dense = _parquet._dense(struct.filter(pa.array([True, False, True, False])))  # no sparse
    assert dense.to_pylist() == [[1.0, 2.0, 3.0], None]
    assert dense.type == pa.list_(pa.float32())


def test_every_row_group_goes_to_one_rank_in_order_and_the_shares_are_even(written):
    import pyarrow.parquet as pq

    specs = column_specs(_spark_schema(written), ["v"], ["k"])
    plan = _parquet.plan(written, specs, 2)
    pieces = [(f, g) for share in plan[1] for f, groups in share for g in groups]
    every = [(f, g) for f in sorted({f for f, _ in pieces})
             for g in range(pq.ParquetFile(f).num_row_groups)]
    assert sorted(pieces) == every and len(set(pieces)) == len(pieces)
    sizes = [sum(pq.ParquetFile(f).metadata.row_group(g).num_rows for f, groups in share
                 for g in groups) for share in plan[1]]
    largest = max(pq.ParquetFile(f).metadata.row_group(g).num_rows for f, g in pieces)
    assert abs(sizes[0] - sizes[1]) <= 2 * largest


def _spark_schema(path):
    from pyspark.sql import SparkSession

    return SparkSession.active().read.parquet(path).schema


def test_no_plan_where_pyarrow_cannot_read_it_as_asked(spark, written, tmp_path, monkeypatch):
    specs = column_specs(_spark_schema(written), ["v"], ["k"])
    assert _parquet.plan("s3a://bucket/data.parquet", specs, 2) is None  # a Hadoop scheme
    assert _parquet.plan(written, specs, 10_000) is None  # fewer row groups than ranks
    part = str(tmp_path / "by_k")
    spark.read.parquet(written).write.partitionBy("k").parquet(part)
    assert _parquet.plan(part, column_specs(_spark_schema(part), ["v"], ["k"]), 2) is None
    monkeypatch.setenv("HOROVOD_SPARK_PARQUET_DIRECT", "0")
    assert _parquet.plan(written, specs, 2) is None


def test_fit_on_parquet_trains_from_the_direct_read(spark, tmp_path):
    from pyspark.ml.linalg import Vectors

    from horovod_spark.estimator import TorchEstimator
    import torch

    rng = np.random.default_rng(1)
    x = rng.normal(size=(800, 4))
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0])).astype(np.float64)
    path = str(tmp_path / "reg.parquet")
    spark.createDataFrame([(Vectors.dense(a), float(b)) for a, b in zip(x, y)],
                          ["features", "label"]).repartition(2).write.parquet(path)
    torch.manual_seed(0)
    est = TorchEstimator(num_proc=2, model=torch.nn.Linear(4, 1),
                         optimizer=lambda params: torch.optim.SGD(params, lr=0.05),
                         loss=torch.nn.MSELoss(), feature_cols=["features"], label_cols=["label"],
                         batch_size=32, epochs=8, store=str(tmp_path / "store"), verbose=0)
    model = est.fit_on_parquet(path)
    assert est._last_timings["parquet_direct"] is True
    loss = model.getHistory()["loss"]
    assert loss[-1] < loss[0] / 20
