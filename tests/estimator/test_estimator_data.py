"""The data path without Spark: column specs, the spill of a partition, the rank's stream."""
import os

import numpy as np
import pyarrow as pa
import pytest

from horovod_spark.estimator._reader import BatchStream, Shard, sequential_batches, steps_per_epoch
from horovod_spark.estimator._spill import spill_partition
from horovod_spark.estimator.data import ColumnSpec

SPECS = (ColumnSpec("x", "feature", "array", "float32", "array<float>"),
         ColumnSpec("y", "label", "scalar", "int64", "bigint"))


def _batches(n, width=3, chunk=100, start=0):
    """Record batches as Spark's mapInArrow hands them: lists of floats, int64 labels."""
    for i in range(start, start + n, chunk):
        rows = np.arange(i, min(i + chunk, start + n))
        x = (rows[:, None] * width + np.arange(width)).astype(np.float32)
        yield pa.RecordBatch.from_arrays(
            [pa.array(list(x)), pa.array(rows)], names=["x", "y"])


def _shard(tmp_path, n, **kw):
    census = spill_partition(_batches(n, **kw), SPECS, 0, directory=str(tmp_path))
    assert census.problem is None
    return census, Shard(os.path.join(str(tmp_path), "train.arrow"), ["x", "y"])


def test_spilled_rows_read_back_unchanged_and_zero_copy(tmp_path):
    census, shard = _shard(tmp_path, 1003)
    assert (census.train_rows, census.widths) == (1003, {"x": 3, "y": 0})
    rows = np.concatenate([b["y"] for b in sequential_batches(shard, 64)])
    x = np.concatenate([b["x"] for b in sequential_batches(shard, 64)])
    np.testing.assert_array_equal(rows, np.arange(1003))
    np.testing.assert_array_equal(x, rows[:, None] * 3 + np.arange(3))
    assert not shard.blocks[0]["x"].flags.owndata  # a view of the memory map


@pytest.mark.parametrize("shuffle", [False, True])
def test_every_pass_of_the_stream_visits_each_row_once(tmp_path, shuffle):
    _, shard = _shard(tmp_path, 1003)
    stream = BatchStream(shard, 64, shuffle=shuffle, seed=3, window_bytes=300 * 16)
    steps = steps_per_epoch([1003], 64)
    seen = np.concatenate([b["y"] for e in range(3) for b in stream.epoch(e, steps)])
    assert len(seen) == 3 * steps * 64
    for p in range(len(seen) // 1003):
        assert sorted(seen[p * 1003:(p + 1) * 1003].tolist()) == list(range(1003))
    assert (np.diff(seen[:1003]) == 1).all() != shuffle


def test_batches_pair_features_with_their_labels(tmp_path):
    _, shard = _shard(tmp_path, 500)
    for b in BatchStream(shard, 32, shuffle=True, window_bytes=1000).epoch(0, 20):
        assert b["x"].shape == (32, 3)
        np.testing.assert_array_equal(b["x"][:, 0], b["y"] * 3)


def test_an_epoch_read_alone_equals_that_epoch_of_the_whole_stream(tmp_path):
    _, shard = _shard(tmp_path, 777)
    stream = BatchStream(shard, 50, shuffle=True, seed=1, window_bytes=2000)
    whole = [b["y"] for e in range(4) for b in stream.epoch(e, 9)]
    fresh = BatchStream(shard, 50, shuffle=True, seed=1, window_bytes=2000)
    alone = [b["y"] for b in fresh.epoch(3, 9)]
    np.testing.assert_array_equal(np.concatenate(alone), np.concatenate(whole[27:]))


def test_shuffle_differs_per_rank_and_per_epoch(tmp_path):
    _, shard = _shard(tmp_path, 400)
    first = lambda rank, epoch: next(BatchStream(shard, 400, seed=0, rank=rank).epoch(epoch, 1))["y"]
    assert not np.array_equal(first(0, 0), first(1, 0))
    assert not np.array_equal(first(0, 0), first(0, 1))


def test_steps_per_epoch_is_the_global_rows_over_the_global_batch():
    assert steps_per_epoch([1000, 10], 10) == 51  # ranks run the same steps, however uneven
    assert steps_per_epoch([5, 5], 100) == 1
    assert steps_per_epoch([100, 100], 10, multiple=3) == 12


def test_validation_fraction_splits_rows_without_losing_any(tmp_path):
    census = spill_partition(_batches(2000), SPECS, 0, validation_fraction=0.25,
                             directory=str(tmp_path))
    assert census.train_rows + census.val_rows == 2000
    assert 400 < census.val_rows < 600
    train = Shard(os.path.join(str(tmp_path), "train.arrow"))
    val = Shard(os.path.join(str(tmp_path), "val.arrow"))
    ys = [np.concatenate([b["y"] for b in sequential_batches(s, 999)]) for s in (train, val)]
    assert sorted(np.concatenate(ys).tolist()) == list(range(2000))


def test_nan_in_a_feature_is_reported_with_its_column(tmp_path):
    bad = pa.RecordBatch.from_arrays([pa.array([[1.0, 2.0, float("nan")]], pa.list_(pa.float32())),
                                      pa.array([7])], names=["x", "y"])
    census = spill_partition(iter([next(_batches(10)), bad]), SPECS, 4, directory=str(tmp_path))
    assert census.problem == "feature column 'x' has NaN (first in row 10 of partition 4)"


def test_nan_in_a_float_label_is_reported_with_its_row(tmp_path):
    specs = (SPECS[0], ColumnSpec("y", "label", "scalar", "float32", "double"))
    good = pa.RecordBatch.from_arrays([pa.array([[1.0, 2.0, 3.0]] * 5, pa.list_(pa.float32())),
                                       pa.array([0.5] * 5)], names=["x", "y"])
    bad = pa.RecordBatch.from_arrays([pa.array([[1.0, 2.0, 3.0]] * 3, pa.list_(pa.float32())),
                                      pa.array([0.5, float("inf"), float("nan")])], names=["x", "y"])
    census = spill_partition(iter([good, bad]), specs, 1, directory=str(tmp_path))
    assert census.problem == "label column 'y' has NaN (first in row 7 of partition 1)"


def test_arrays_of_different_lengths_are_reported(tmp_path):
    ragged = pa.RecordBatch.from_arrays([pa.array([[1.0, 2.0], [1.0]], pa.list_(pa.float32())),
                                         pa.array([1, 2])], names=["x", "y"])
    census = spill_partition(iter([ragged]), SPECS, 0, directory=str(tmp_path))
    assert "column 'x' has arrays of different lengths (2 and 1)" in census.problem


def test_null_labels_are_reported(tmp_path):
    nulls = pa.RecordBatch.from_arrays([pa.array([[1.0, 2.0, 3.0]] * 2, pa.list_(pa.float32())),
                                        pa.array([1, None])], names=["x", "y"])
    census = spill_partition(iter([nulls]), SPECS, 0, directory=str(tmp_path))
    assert census.problem == "column 'y' has 1 null value(s)"


def test_a_shard_with_no_rows_is_refused_by_the_stream(tmp_path):
    census = spill_partition(iter(()), SPECS, 2, directory=str(tmp_path))
    assert census.train_rows == 0
    shard = Shard(os.path.join(str(tmp_path), "train.arrow"), ["x", "y"])
    with pytest.raises(ValueError, match="rank 2 has no training rows"):
        BatchStream(shard, 8, rank=2)


@pytest.mark.spark
def test_the_transfer_conf_hands_the_same_batches_and_restores_the_session(spark):
    from horovod_spark.estimator.data import TRANSFER_CONF, transfer_conf

    key = "spark.sql.execution.arrow.maxBytesPerBatch"
    df = spark.range(0, 25_000, numPartitions=1).selectExpr("id", "array(id, id + 1) AS x")

    def sizes(batches):
        yield pa.RecordBatch.from_arrays([pa.array([b.num_rows for b in batches])], ["rows"])

    spark.conf.set(key, "1m")
    try:
        with transfer_conf(spark):
            assert spark.conf.get(key) == TRANSFER_CONF[key]
            rows = df.mapInArrow(sizes, "rows long").collect()
        assert spark.conf.get(key) == "1m"
    finally:
        spark.conf.unset(key)
    assert [r.rows for r in rows] == [10_000, 10_000, 5_000]  # maxRecordsPerBatch still holds
    with transfer_conf(spark):
        pass
    assert spark.conf.get(key, None) is None  # unset before, unset after


# -- bytes and text, and decode_fn ----------------------------------------------------------
OBJ_SPECS = (ColumnSpec("blob", "feature", "binary", "object", "binary"),
             ColumnSpec("y", "label", "scalar", "int64", "bigint"))


def _blob_batches(n, chunk=50):
    for i in range(0, n, chunk):
        rows = np.arange(i, min(i + chunk, n))
        yield pa.RecordBatch.from_arrays(
            [pa.array([b"row%d" % r * (r % 5 + 1) for r in rows], pa.binary()), pa.array(rows)],
            names=["blob", "y"])


def test_bytes_stay_arrow_until_their_batch_is_cut_and_pair_with_their_labels(tmp_path):
    census = spill_partition(_blob_batches(301), OBJ_SPECS, 0, directory=str(tmp_path))
    assert census.problem is None and census.train_rows == 301
    shard = Shard(os.path.join(str(tmp_path), "train.arrow"), ["blob", "y"])
    assert isinstance(shard.blocks[0]["blob"], pa.Array)  # no Python objects per row yet
    stream = BatchStream(shard, 16, shuffle=True, seed=1, window_bytes=2000)
    seen = []
    for b in stream.epoch(0, steps_per_epoch([301], 16)):
        assert b["blob"].dtype == object and len(b["blob"]) == 16
        assert [bytes(v) for v in b["blob"]] == [b"row%d" % r * (r % 5 + 1) for r in b["y"]]
        seen += b["y"].tolist()
    assert sorted(seen[:301]) == list(range(301))
    rows = [b for b in sequential_batches(shard, 64)]
    assert [bytes(v) for v in rows[-1]["blob"]][-1] == b"row300" * 1


def test_a_null_in_a_bytes_column_is_named_with_its_row_and_partition(tmp_path):
    batch = pa.RecordBatch.from_arrays([pa.array([b"a", None, b"c"], pa.binary()),
                                        pa.array([0, 1, 2])], names=["blob", "y"])
    census = spill_partition([batch], OBJ_SPECS, 3, directory=str(tmp_path))
    assert census.problem == ("feature column 'blob' has a null (first in row 1 of partition "
                              "3); drop or fill those rows (df.na.drop(subset=['blob']))")


def _slow_square(batch, rng):
    import time

    time.sleep(float(rng.random()) * 0.01)  # threads finish out of order
    return {"x": batch["x"] ** 2, "noise": rng.random(2)}


def test_decode_threads_give_the_streams_order_and_the_same_random_draws_every_run():
    from horovod_spark.estimator._decode import decoded

    def run(workers):
        batches = ({"x": np.full(3, i)} for i in range(40))
        return list(decoded(batches, _slow_square, workers, "test", (7, 1, 0)))

    threaded, alone = run(3), run(0)
    assert [int(b["x"][0]) for b in threaded] == [i * i for i in range(40)]
    for a, b in zip(threaded, alone):
        np.testing.assert_array_equal(a["noise"], b["noise"])
    assert not np.array_equal(threaded[0]["noise"], threaded[1]["noise"])


def test_a_decoder_that_raises_is_named_and_its_threads_end():
    import threading

    from horovod_spark.estimator._decode import DecodeError, decoded

    def bad(batch):
        if batch["x"][0] == 5:
            raise KeyError("no such token")
        return batch

    before = threading.active_count()
    batches = ({"x": np.full(2, i)} for i in range(100))
    with pytest.raises(DecodeError, match=r"decode_fn failed on batch 5 of epoch 2 of "
                                          r"partition 0: KeyError: 'no such token'") as err:
        for _ in decoded(batches, bad, 2, "epoch 2 of partition 0", (0,)):
            pass
    assert "in bad" in str(err.value)  # the decoder's traceback
    assert threading.active_count() == before
