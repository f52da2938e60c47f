"""Bad inputs fail before any training starts, with a message that says what is wrong."""
import numpy as np
import pytest
import torch

from horovod_spark.estimator import TorchEstimator

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def df(spark):
    from pyspark.ml.linalg import Vectors

    x = np.random.default_rng(0).normal(size=(40, 3))
    rows = [(Vectors.dense(r), [float(v) for v in r], float(r.sum()), int(i % 3), f"s{i}")
            for i, r in enumerate(x)]
    out = spark.createDataFrame(rows, ["features", "arr", "y", "cls", "name"]).repartition(2)
    out.cache().count()
    return out


def _fit(df, tmp_path, net=None, **kw):
    net = net if net is not None else torch.nn.Linear(3, 1)
    args = dict(num_proc=2, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                loss=torch.nn.MSELoss(), feature_cols=["features"], label_cols=["y"],
                store=str(tmp_path), verbose=0)
    args.update(kw)
    return TorchEstimator(**args).fit(df)


def test_a_misnamed_column_is_named_with_the_dataframes_columns_and_a_guess(df, tmp_path):
    with pytest.raises(ValueError) as err:
        _fit(df, tmp_path, feature_cols=["feature"])
    assert str(err.value) == ("column(s) ['feature'] not in the DataFrame; its columns are "
                              "['features', 'arr', 'y', 'cls', 'name'] "
                              "(did you mean 'feature' -> 'features'?)")


def test_a_missing_label_column_is_named(df, tmp_path):
    with pytest.raises(ValueError, match=r"column\(s\) \['target'\] not in the DataFrame"):
        _fit(df, tmp_path, label_cols=["target"])


def test_a_string_feature_column_without_a_decode_fn_is_refused_saying_what_to_pass(df,
                                                                                   tmp_path):
    with pytest.raises(TypeError, match="feature column 'name' holds text, which the model "
                                        "can't take: pass decode_fn=fn"):
        _fit(df, tmp_path, feature_cols=["name"])


def test_a_string_label_column_is_refused_naming_string_indexer(df, tmp_path):
    with pytest.raises(TypeError, match="label column 'name' has type string; labels are "
                                        "numbers: index text labels with .*StringIndexer"):
        _fit(df, tmp_path, label_cols=["name"])


def test_features_the_model_cannot_take_are_named_with_their_shape(df, tmp_path):
    with pytest.raises(ValueError, match=r"the model can't take the feature columns 'arr' "
                                         r"float32\[16, 3\] .*mat1 and mat2 shapes"):
        _fit(df, tmp_path, net=torch.nn.Linear(5, 1), feature_cols=["arr"])


def test_a_label_that_does_not_match_the_output_shape_is_refused(df, tmp_path):
    with pytest.raises(ValueError, match=r"label column 'y' has shape \[\] per row but the "
                                         r"model's output for it has shape \[4\] per row"):
        _fit(df, tmp_path, net=torch.nn.Linear(3, 4))


def test_a_class_label_beyond_the_outputs_is_refused(df, tmp_path):
    with pytest.raises(ValueError, match="label column 'cls' has class 2 .* but the model "
                                         "outputs 2 values per row"):
        _fit(df, tmp_path, net=torch.nn.Linear(3, 2), label_cols=["cls"],
             loss=torch.nn.CrossEntropyLoss())


def test_an_empty_dataframe_is_refused(df, tmp_path):
    with pytest.raises(ValueError, match="the DataFrame is empty"):
        _fit(df.filter("y > 1e9"), tmp_path)


def test_nan_in_a_feature_is_refused_naming_the_column(spark, df, tmp_path):
    from pyspark.sql import functions as F

    bad = df.withColumn("arr", F.when(F.col("cls") == 1, F.array(F.lit(1.0), F.lit(float("nan")),
                                                                  F.lit(2.0))).otherwise(F.col("arr")))
    with pytest.raises(ValueError, match=r"feature column 'arr' has NaN \(first in row \d+ of "
                                         r"partition \d\)"):
        _fit(bad, tmp_path, feature_cols=["arr"])


def test_an_optimizer_of_another_model_is_refused(df, tmp_path):
    other = torch.nn.Linear(3, 1)
    with pytest.raises(ValueError, match="the optimizer is not bound to the model's parameters"):
        _fit(df, tmp_path, optimizer=torch.optim.SGD(other.parameters(), lr=0.1))


def test_missing_params_are_listed():
    with pytest.raises(ValueError, match="TorchEstimator needs optimizer, loss; pass"):
        TorchEstimator(model=torch.nn.Linear(3, 1), feature_cols=["a"], label_cols=["b"]) \
            ._fit(None)


def test_unknown_constructor_arguments_are_refused():
    with pytest.raises(TypeError, match=r"unknown parameter\(s\) \['epoch'\]"):
        TorchEstimator(epoch=3)


@pytest.mark.parametrize("value, error", [(1.5, "must be in \\[0, 1\\)"), ([0.1], "fraction")])
def test_a_bad_validation_value_is_refused(value, error):
    with pytest.raises((TypeError, ValueError), match=error):
        TorchEstimator(validation=value)


def test_the_partition_count_of_a_shuffled_dataframe_is_read_without_running_it(spark):
    from horovod_spark.estimator._launch import partitions

    tracker = spark.sparkContext.statusTracker()
    shuffled = spark.range(1000).selectExpr("id", "rand() as x").repartition(3)
    before = len(tracker.getJobIdsForGroup(None))
    assert partitions(shuffled) == 3
    assert partitions(spark.range(0, 10, 1, 5)) == 5
    assert len(tracker.getJobIdsForGroup(None)) == before  # no job ran
