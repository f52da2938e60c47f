"""Variable-length array columns in the estimators: `array_padding` pads every row to a
length (or cuts it), pads each batch to its longest row, or hands the rows to decode_fn to
collate; in training, in the driver's checks and in Model.transform (the rule is saved with
the model).  A ragged column with no rule, a rule on the wrong column, a null element: named
errors before training or at the spill.

Data: scikit-learn's digits as token lists, the indices of each image's inked pixels
(10 to 50 per row), a bag of words in effect.  Nothing downloaded.
"""
import sys

import cloudpickle
import numpy as np
import pyarrow as pa
import pytest
import torch

from horovod_spark.estimator import TorchEstimator, TorchModel
from horovod_spark.estimator._reader import BatchStream, Shard
from horovod_spark.estimator._spill import spill_partition
from horovod_spark.estimator.data import ColumnSpec, arrow_to_numpy, padding_rule

pytestmark = pytest.mark.spark
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the model and decoders travel
ROWS = 500
PAD = -1.0


class Bag(torch.nn.Module):
    """Token ids (PAD where there is none) to class scores: a sum of embeddings, so its
    output does not depend on how far a row is padded.  Seeded: the same weights each time."""

    def __init__(self):
        torch.manual_seed(0)
        super().__init__()
        self.emb = torch.nn.Embedding(65, 10, padding_idx=64)

    def forward(self, tokens):
        return self.emb(torch.where(tokens < 0, 64, tokens).long()).sum(1)


def bag_of_tokens(batch):
    """'collate': the rows (1-D arrays of their own lengths) to 64 counts a row."""
    import numpy as np

    out = np.zeros((len(batch["tokens"]), 64), np.float32)
    for i, row in enumerate(batch["tokens"]):
        np.add.at(out[i], row.astype(np.int64), 1.0)
    batch["tokens"] = out
    return batch


def _tokens(pixels: np.ndarray) -> list:
    return [int(j) for j in np.flatnonzero(pixels > 4)]


@pytest.fixture(scope="module")
def digits_as_tokens(spark):
    from sklearn.datasets import load_digits

    data = load_digits()
    rows = [(i, _tokens(data.data[i]), int(data.target[i])) for i in range(ROWS)]
    assert len({len(r[1]) for r in rows}) > 10  # ragged indeed
    df = spark.createDataFrame(spark.sparkContext.parallelize(rows, 2),
                               "id int, tokens array<int>, label bigint")
    df.cache().count()
    return df, rows


def _estimator(tmp_path, net, padding, **kw):
    torch.manual_seed(0)
    args = dict(num_proc=2, model=net, optimizer=torch.optim.Adam(net.parameters(), lr=0.05),
                loss=torch.nn.CrossEntropyLoss(), feature_cols=["tokens"], label_cols=["label"],
                batch_size=32, epochs=4, store=str(tmp_path), verbose=0,
                array_padding=padding)
    args.update(kw)
    return TorchEstimator(**args)


def _predictions(model, df):
    rows = model.transform(df).select("id", "tokens", "label", "label__output").collect()
    return rows, np.stack([r["label__output"].toArray() for r in rows])


def _padded(rows, width=None):
    width = width or max(len(r["tokens"]) for r in rows)
    out = np.full((len(rows), width), PAD, np.float32)
    for i, r in enumerate(rows):
        out[i, :len(r["tokens"][:width])] = r["tokens"][:width]
    return out


# -- the rules, on Arrow arrays and through a rank's shard ------------------------------

def test_the_rules_pad_cut_and_collate_arrow_lists_and_their_slices():
    array = pa.array([[1, 2, 3], [4], [], [5, 6]], pa.list_(pa.int32())).slice(1)
    np.testing.assert_array_equal(arrow_to_numpy(array, "float32", "t", padding_rule("t", 1)),
                                  [[4], [0], [5]])
    np.testing.assert_array_equal(
        arrow_to_numpy(array, "float32", "t", padding_rule("t", ("longest", -1))),
        [[4, -1], [-1, -1], [5, 6]])
    rows = arrow_to_numpy(array, "float32", "t", padding_rule("t", "collate"))
    assert rows.dtype == object and [r.tolist() for r in rows] == [[4], [], [5, 6]]
    assert rows[0].dtype == np.float32
    with pytest.raises(ValueError, match=r"column 't' has arrays of different lengths \(1 and "
                                         r"0\); pass array_padding=\{'t': n\}"):
        arrow_to_numpy(array, "float32", "t")
    for bad in (0, -3, "shortest", ("collate", 1), 2.5, True):
        with pytest.raises(ValueError, match=r"array_padding for column 't' is .*; give n or "
                                             r"\(n, value\), 'longest'"):
            padding_rule("t", bad)


def test_a_shard_keeps_its_rows_lengths_and_pads_each_batch_to_its_longest(tmp_path):
    spec = ColumnSpec("t", "feature", "array", "float32", "array<int>",
                      tuple(padding_rule("t", ("longest", PAD))))
    label = ColumnSpec("y", "label", "scalar", "int64", "bigint")
    lengths = [1, 5, 2, 2, 3, 1, 0, 4]
    batch = pa.RecordBatch.from_arrays(
        [pa.array([[float(k)] * n for k, n in enumerate(lengths)], pa.list_(pa.float32())),
         pa.array(range(8), pa.int64())], names=["t", "y"])
    census = spill_partition([batch], [spec, label], 0, directory=str(tmp_path))
    assert census.problem is None and census.train_rows == 8
    shard = Shard(str(tmp_path / "train.arrow"), ["t", "y"], {"t": spec.pad})
    try:
        got = list(BatchStream(shard, 4, shuffle=False).epoch(0, 2))
    finally:
        shard.close()
    assert [b["t"].shape for b in got] == [(4, 5), (4, 4)]
    np.testing.assert_array_equal(got[0]["t"][1], [1.0] * 5)
    np.testing.assert_array_equal(got[1]["t"][2], [PAD] * 4)  # the empty row
    np.testing.assert_array_equal(got[1]["y"], [4, 5, 6, 7])


def test_a_null_element_or_nan_is_named_with_its_row_and_partition(tmp_path):
    spec = ColumnSpec("t", "feature", "array", "float32", "array<float>", ("longest", 0.0))
    for value, what in ((None, "a null element"), (float("nan"), "NaN")):
        batch = pa.RecordBatch.from_arrays(
            [pa.array([[1.0], [2.0, 3.0], [4.0, value]], pa.list_(pa.float32()))], names=["t"])
        (tmp_path / what).mkdir()
        census = spill_partition([batch], [spec], 3, directory=str(tmp_path / what))
        assert census.problem == (f"feature column 't' has {what} (first in row 2 of "
                                  f"partition 3)"), census.problem


# -- fits on Spark ------------------------------------------------------------------------

def test_rows_padded_to_a_length_train_and_predict_with_the_same_padding(digits_as_tokens,
                                                                          tmp_path):
    df, _ = digits_as_tokens
    model = _estimator(tmp_path, Bag(), {"tokens": (40, PAD)}, epochs=6).fit(df)
    history = model.getHistory()["loss"]
    assert history[-1] < history[0] * 0.5, history
    rows, got = _predictions(model, df)
    with torch.no_grad():  # rows cut at 40 tokens, as the rule says
        want = model.getModel()(torch.from_numpy(_padded(rows, 40))).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    accuracy = (got.argmax(1) == [r["label"] for r in rows]).mean()
    assert accuracy > 0.8, accuracy


def test_rows_padded_to_each_batchs_longest_train_and_the_rule_is_saved(digits_as_tokens,
                                                                         tmp_path):
    df, _ = digits_as_tokens
    model = _estimator(tmp_path, Bag(), {"tokens": ("longest", PAD)}, validation=0.2).fit(df)
    assert model.getHistory()["val_loss"][-1] < model.getHistory()["val_loss"][0]
    rows, got = _predictions(model, df)
    with torch.no_grad():
        want = model.getModel()(torch.from_numpy(_padded(rows))).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    model.write().overwrite().save(str(tmp_path / "saved"))
    loaded = TorchModel.load(str(tmp_path / "saved"))
    assert loaded.getOrDefault("array_padding") == {"tokens": ["longest", PAD]}
    _, again = _predictions(loaded, df)
    np.testing.assert_allclose(again, got, rtol=1e-6, atol=1e-6)


def test_collated_rows_reach_decode_fn_as_arrays_of_their_own_lengths(digits_as_tokens,
                                                                        tmp_path):
    df, _ = digits_as_tokens
    torch.manual_seed(0)
    net = torch.nn.Linear(64, 10)
    model = _estimator(tmp_path, net, {"tokens": "collate"}, decode_fn=bag_of_tokens,
                       decode_workers=2).fit(df)
    history = model.getHistory()["loss"]
    assert history[-1] < history[0] * 0.5, history
    rows, got = _predictions(model, df.limit(50))
    bags = bag_of_tokens({"tokens": [np.array(r["tokens"], np.float32) for r in rows]})["tokens"]
    with torch.no_grad():
        want = model.getModel()(torch.from_numpy(bags)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_ragged_rows_with_no_rule_and_misplaced_rules_are_refused_before_training(
        digits_as_tokens, tmp_path):
    df, _ = digits_as_tokens
    with pytest.raises(ValueError, match=r"column 'tokens' has arrays of different lengths "
                                         r"\(\d+ and \d+\); pass array_padding=\{'tokens': n\}"):
        _estimator(tmp_path, Bag(), None).fit(df)
    with pytest.raises(ValueError, match=r"array_padding gives column\(s\) \['tokens'\] the "
                                         r"rule 'collate', which hands their rows to decode_fn; "
                                         r"pass decode_fn=fn"):
        _estimator(tmp_path, Bag(), {"tokens": "collate"}).fit(df)
    with pytest.raises(TypeError, match=r"array_padding names label column 'label' of type "
                                        r"bigint; padding is for array columns"):
        _estimator(tmp_path, Bag(), {"tokens": 40, "label": 3}).fit(df)
    with pytest.raises(ValueError, match=r"array_padding names column\(s\) \['token'\] that "
                                         r"are not feature or label columns"):
        _estimator(tmp_path, Bag(), {"token": 40}).fit(df)
    with pytest.raises(TypeError, match=r"array_padding must be a dict of column name -> rule"):
        _estimator(tmp_path, Bag(), 40)


# -- sparse vectors kept sparse (sparse_vectors="sparse") ---------------------------------

VECTOR = pa.struct([("type", pa.int8()), ("size", pa.int32()),
                    ("indices", pa.list_(pa.int32())), ("values", pa.list_(pa.float64()))])


def _vectors(rows):
    return pa.array([{"type": 0, "size": s, "indices": i, "values": v} if i is not None else
                     {"type": 1, "size": None, "indices": None, "values": v}
                     for s, i, v in rows], VECTOR)


def test_sparse_and_dense_vectors_become_csr_rows_and_torch_sparse_batches():
    from horovod_spark.estimator._torch_io import to_inputs
    from horovod_spark.estimator.data import sparse_rows

    column = _vectors([(4, [1, 3], [2.0, 5.0]), (None, None, [1.0, 2.0, 3.0, 4.0]),
                       (4, [0], [7.0]), (4, [], [])])
    want = [[0, 2, 0, 5], [1, 2, 3, 4], [7, 0, 0, 0], [0, 0, 0, 0]]
    for start in (0, 1, 2):
        rows = sparse_rows(column.slice(start), "v")
        np.testing.assert_array_equal(rows.toarray(), want[start:])
    rows = sparse_rows(column, "v")
    assert rows.shape == (4, 4) and len(rows[1:3]) == 2
    np.testing.assert_array_equal(rows[1:3].toarray(), want[1:3])
    (batch,) = to_inputs([rows])
    assert batch.is_sparse and batch.dtype == torch.float32
    np.testing.assert_array_equal(batch.to_dense().numpy(), want)


def test_bad_vectors_are_named_with_their_column_and_partition(tmp_path):
    from horovod_spark.estimator.data import SPARSE

    spec = ColumnSpec("v", "feature", "vector", "float32", "vector", SPARSE)
    cases = [(_vectors([(4, [1], [1.0]), (5, [2], [1.0])]),
              "feature column 'v' has vectors of sizes 4 and 5; every row needs the same size "
              "(in partition 2)"),
             (_vectors([(4, [1], [1.0]), (4, [2], [float("nan")])]),
              "feature column 'v' has NaN (in partition 2)"),
             (pa.array([{"type": 0, "size": 4, "indices": [1], "values": [1.0]}, None], VECTOR),
              "feature column 'v' has a null (first in row 1 of partition 2); drop or fill "
              "those rows")]
    for i, (column, message) in enumerate(cases):
        (tmp_path / str(i)).mkdir()
        census = spill_partition([pa.RecordBatch.from_arrays([column], names=["v"])], [spec], 2,
                                 directory=str(tmp_path / str(i)))
        assert census.problem == message, census.problem


def test_fit_on_parquet_reads_ragged_arrays_and_sparse_vectors_directly(spark, tmp_path):
    """The direct Parquet read (the tasks read row groups with pyarrow, no JVM in between)
    keeps both rules: ragged token lists padded per batch, Vectors kept sparse."""
    from pyspark.ml.linalg import Vectors

    rng = np.random.default_rng(0)
    rows = []
    for i in range(200):
        label = i % 2
        tokens = [int(t) for t in rng.integers(0, 32, rng.integers(1, 9)) + 32 * label]
        rows.append((tokens, Vectors.sparse(64, {t: 1.0 for t in sorted(set(tokens))}), label))
    path = str(tmp_path / "data.parquet")
    spark.createDataFrame(rows, ["tokens", "bag", "label"]).repartition(2).write.parquet(path)
    for feature, kw, net in (("tokens", {"array_padding": {"tokens": ("longest", PAD)}}, Bag()),
                             ("bag", {"sparse_vectors": "sparse"}, SparseBag())):
        model = _estimator(tmp_path / feature, net, None, feature_cols=[feature], epochs=3,
                           **kw).fit_on_parquet(path)
        history = model.getHistory()["loss"]
        assert history[-1] < history[0], (feature, history)


class SparseBag(torch.nn.Module):
    def __init__(self):
        torch.manual_seed(0)
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(64, 10) * 0.01)

    def forward(self, x):
        assert x.is_sparse
        return torch.sparse.mm(x, self.weight)
