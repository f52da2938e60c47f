"""TorchEstimator on real Spark (local[2]): training, pipelines, resume, uneven data,
Horovod's backend and input_shapes."""
import os
import sys

import cloudpickle
import numpy as np
import pytest
import torch

from horovod_spark.estimator import LocalStore, SparkBackend, TorchEstimator, TorchModel

pytestmark = [pytest.mark.spark, pytest.mark.slow]
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks can't import tests


def accuracy(output, label):
    return (output.argmax(dim=1) == label).float().mean()


def _mlp(inputs, outputs, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(inputs, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, outputs))


def _classifier(store, **kw):
    net = _mlp(64, 10)
    args = dict(num_proc=2, model=net, optimizer=torch.optim.Adam(net.parameters(), lr=0.01),
                loss=torch.nn.CrossEntropyLoss(), metrics=[accuracy],
                feature_cols=["features"], label_cols=["label"], batch_size=32, epochs=6,
                store=store, verbose=0)
    args.update(kw)
    return TorchEstimator(**args)


def _test_accuracy(model, test_df, expected_rows):
    rows = model.transform(test_df).select("label", "label__output").collect()
    assert len(rows) == expected_rows
    return np.mean([np.argmax(r.label__output.toArray()) == r.label for r in rows])


def test_a_classifier_on_digits_reaches_90_percent_test_accuracy(digits, tmp_path):
    train, test, (x_test, _) = digits
    model = _classifier(str(tmp_path), validation=0.1).fit(train)
    assert isinstance(model, TorchModel)
    history = model.getHistory()
    assert set(history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert all(len(v) == 6 for v in history.values())
    assert history["loss"][-1] < history["loss"][0] / 3
    assert history["val_accuracy"][-1] >= 0.9
    assert _test_accuracy(model, test, len(x_test)) >= 0.9
    assert os.path.exists(LocalStore(str(tmp_path)).model_path(model.getRunId()))


def test_fitting_again_with_the_same_run_id_resumes_after_the_last_checkpoint(
        spark, digits, tmp_path):
    train, test, (x_test, _) = digits
    store = LocalStore(str(tmp_path / "store"))
    path = str(tmp_path / "digits.parquet")
    train.write.parquet(path)
    first = _classifier(store, epochs=2, run_id="resumable").fit_on_parquet(path)
    assert store.checkpoint_epochs("resumable") == [0, 1]
    second = _classifier(store, epochs=5, run_id="resumable").fit_on_parquet(path)
    assert store.checkpoint_epochs("resumable") == [3, 4]
    h1, h2 = first.getHistory(), second.getHistory()
    assert len(h2["loss"]) == 5 and h2["loss"][:2] == h1["loss"]
    assert h2["loss"][2] < h1["loss"][0]  # it went on from the trained weights, not from scratch
    assert _test_accuracy(second, test, len(x_test)) >= 0.9


def test_a_pipeline_with_vector_assembler_and_standard_scaler_fits_saves_and_loads(
        spark, tmp_path):
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.feature import StandardScaler, VectorAssembler

    rng = np.random.default_rng(0)
    x = rng.normal(size=(1200, 4)) * [1, 10, 100, 0.1] + [0, 5, -50, 1]
    w = np.array([1.0, 0.1, 0.01, 10.0])
    y = (x - [0, 5, -50, 1]) @ w
    df = spark.createDataFrame([tuple(map(float, r)) + (float(t),) for r, t in zip(x, y)],
                               ["a", "b", "c", "d", "y"]).repartition(2)
    net = torch.nn.Linear(4, 1)
    est = TorchEstimator(num_proc=2, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.05),
                         loss=torch.nn.MSELoss(), feature_cols=["scaled"], label_cols=["y"],
                         batch_size=16, epochs=8, store=str(tmp_path / "store"), verbose=0,
                         backward_passes_per_step=2)
    pipeline = Pipeline(stages=[VectorAssembler(inputCols=["a", "b", "c", "d"], outputCol="raw"),
                                StandardScaler(inputCol="raw", outputCol="scaled", withMean=True),
                                est])
    fitted = pipeline.fit(df)
    fitted.write().overwrite().save(str(tmp_path / "pipeline"))
    loaded = PipelineModel.load(str(tmp_path / "pipeline"))
    before = fitted.transform(df).orderBy("a").select("y", "y__output").collect()
    after = loaded.transform(df).orderBy("a").select("y__output").collect()
    assert [r.y__output for r in before] == [r.y__output for r in after]
    pred, truth = np.array([r.y__output for r in before]), np.array([r.y for r in before])
    assert np.sqrt(np.mean((pred - truth) ** 2)) < 0.1 * truth.std()


def test_uneven_partitions_run_the_same_steps_on_every_rank(spark, tmp_path, capfd):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(1000, 3))
    y = x @ [1.0, -2.0, 0.5]
    # rows with weight 0 have labels that would ruin the fit if they counted
    weight = (np.arange(1000) % 5 != 0).astype(float)
    y = np.where(weight > 0, y, 1000.0)
    rows = [(r.tolist(), float(t), float(wt)) for r, t, wt in zip(x, y, weight)]
    df = spark.createDataFrame(rows, ["x", "y", "w"]).coalesce(1)
    df = df.rdd.zipWithIndex().map(lambda p: (p[1] % 10 == 0, p[0])) \
        .partitionBy(2, lambda small: int(small)).map(lambda p: p[1]).toDF(["x", "y", "w"])
    sizes = df.rdd.glom().map(len).collect()
    assert sorted(sizes) == [100, 900]
    net = torch.nn.Linear(3, 1)
    model = TorchEstimator(num_proc=2, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                           loss=torch.nn.MSELoss(), feature_cols=["x"], label_cols=["y"],
                           sample_weight_col="w", batch_size=25, epochs=3, verbose=2,
                           store=str(tmp_path)).fit(df)
    out = capfd.readouterr().out
    for rank, rows_ in enumerate(sizes):
        assert f"rank {rank}: {rows_} training rows, 0 validation rows, 20 steps per epoch" in out
    np.testing.assert_allclose(model.getModel().weight.detach().numpy()[0], [1.0, -2.0, 0.5],
                               atol=0.05)


def _tiny_fit(df, store, verbose=1):
    net = torch.nn.Linear(2, 1)
    return TorchEstimator(num_proc=2, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                          loss=torch.nn.MSELoss(), feature_cols=["x"], label_cols=["y"],
                          epochs=1, store=store, verbose=verbose).fit(df)


def _tiny_rows(n=200):
    x = np.random.default_rng(2).normal(size=(n, 2))
    return [(r.tolist(), float(r.sum())) for r in x]


def test_a_partition_with_no_rows_is_repartitioned_before_training(spark, tmp_path, capfd):
    rdd = spark.sparkContext.parallelize(_tiny_rows(), 2).map(lambda r: (0, r)) \
        .partitionBy(2, lambda key: key).values()
    df = spark.createDataFrame(rdd, "x array<double>, y double")
    assert df.rdd.glom().map(len).collect() == [200, 0]
    assert len(_tiny_fit(df, str(tmp_path)).getHistory()["loss"]) == 1
    assert "partition(s) [1] of 2 have no training rows (rows per partition: [200, 0]); " \
           "repartitioning" in capfd.readouterr().out


def test_partitions_made_by_coalesce_are_repartitioned_for_the_barrier_stage(
        spark, tmp_path, capfd):
    df = spark.createDataFrame(_tiny_rows(), "x array<double>, y double").repartition(4) \
        .coalesce(2)
    assert df.rdd.getNumPartitions() == 2
    assert len(_tiny_fit(df, str(tmp_path)).getHistory()["loss"]) == 1
    assert "a barrier stage can't start from; repartitioning" in capfd.readouterr().out


class TwoScalars(torch.nn.Module):
    """Takes two scalar feature columns, each (batch, 1)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)

    def forward(self, a, b):
        return self.linear(torch.cat([a, b], dim=1))


def test_cross_validator_fits_scalar_feature_columns_and_picks_a_model(spark, tmp_path):
    from pyspark.ml.evaluation import RegressionEvaluator
    from pyspark.ml.tuning import CrossValidator, ParamGridBuilder

    x = np.random.default_rng(3).normal(size=(600, 2))
    df = spark.createDataFrame([(float(a), float(b), float(2 * a - b)) for a, b in x],
                               ["a", "b", "y"])
    net = TwoScalars()
    est = TorchEstimator(num_proc=2, model=net, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                         loss=torch.nn.MSELoss(), feature_cols=["a", "b"], label_cols=["y"],
                         epochs=3, store=str(tmp_path), verbose=0)
    grid = ParamGridBuilder().addGrid(est.batch_size, [16]).build()
    evaluator = RegressionEvaluator(labelCol="y", predictionCol="y__output", metricName="rmse")
    cv = CrossValidator(estimator=est, estimatorParamMaps=grid, evaluator=evaluator, numFolds=2,
                        seed=0).fit(df)
    assert cv.avgMetrics[0] < 0.1
    assert evaluator.evaluate(cv.bestModel.transform(df)) < 0.1


def test_a_validation_column_a_transformation_and_an_fsspec_store(spark, tmp_path):
    from horovod_spark.estimator import FilesystemStore

    x = np.random.default_rng(4).normal(size=(400, 2))
    rows = [(r.tolist(), float(2 * r.sum()), i % 4 == 0) for i, r in enumerate(x)]
    df = spark.createDataFrame(rows, "x array<double>, y double, held_out boolean")

    def doubled(batch):  # the ranks see 2x, so the model should learn weights of 1
        return dict(batch, x=batch["x"] * 2)

    store = FilesystemStore(f"file://{tmp_path}/fs")
    net = torch.nn.Linear(2, 1, bias=False)
    model = TorchEstimator(num_proc=2, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.05),
                           loss=torch.nn.MSELoss(), feature_cols=["x"], label_cols=["y"],
                           validation="held_out", transformation_fn=doubled, batch_size=10,
                           epochs=3, store=store, run_id="fsspec", verbose=0).fit(df)
    assert model.getHistory()["val_loss"][-1] < 1e-3
    np.testing.assert_allclose(model.getModel().weight.detach().numpy()[0], [1.0, 1.0], atol=0.02)
    assert store.checkpoint_epochs("fsspec") == [1, 2]
    assert store.exists(store.model_path("fsspec"))


def test_an_error_in_training_is_raised_on_the_driver_naming_the_rank(spark, tmp_path):
    from horovod_spark._job.driver import JobFailedError

    def fails_in_training(batch):  # the dry run's 16 rows pass; training batches of 32 fail
        if len(batch["y"]) > 16:
            raise ValueError("boom in transformation_fn")
        return batch

    df = spark.createDataFrame(_tiny_rows(), "x array<double>, y double").repartition(2)
    net = torch.nn.Linear(2, 1)
    with pytest.raises(JobFailedError, match=r"rank \d/2.*ValueError: boom in transformation_fn"):
        TorchEstimator(num_proc=2, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                       loss=torch.nn.MSELoss(), feature_cols=["x"], label_cols=["y"],
                       transformation_fn=fails_in_training, store=str(tmp_path),
                       verbose=0).fit(df)


# Horovod's backend and input_shapes params: a convolutional model fits digit rows of 64
# values as 1x8x8 images, as Horovod's MNIST examples pass them, and its Model reshapes
# the same way in transform, after a save/load.
class HorovodLikeBackend:
    """What Horovod's SparkBackend offers an estimator: the number of processes."""

    def num_processes(self):
        return 2


def _conv_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 10))


def _conv_estimator(tmp_path, **kw):
    net = _conv_net()
    args = dict(model=net, optimizer=torch.optim.Adam(net.parameters(), lr=0.01),
                loss=torch.nn.CrossEntropyLoss(), feature_cols=["features"],
                label_cols=["label"], batch_size=32, epochs=3, store=str(tmp_path), verbose=0)
    args.update(kw)
    return TorchEstimator(**args)


def test_a_conv_model_trains_on_rows_reshaped_by_input_shapes_with_a_backend(digits, tmp_path):
    train, test, (x_test, y_test) = digits
    est = _conv_estimator(tmp_path, backend=HorovodLikeBackend(), input_shapes=[[-1, 1, 8, 8]])
    model = est.fit(train)
    assert model.getOrDefault("input_shapes") == [[-1, 1, 8, 8]]
    path = str(tmp_path / "model")
    model.write().overwrite().save(path)
    for m in (model, TorchModel.load(path)):
        rows = m.transform(test).select("label", "label__output").collect()
        accuracy = np.mean([np.argmax(r.label__output.toArray()) == r.label for r in rows])
        assert len(rows) == len(y_test) and accuracy > 0.8, accuracy


def test_a_shape_without_minus_one_is_one_rows_and_spark_backend_counts_ranks():
    from horovod_spark.estimator.backend import num_proc, reshape

    rows = np.arange(3 * 64, dtype=np.float32).reshape(3, 64)
    assert reshape(rows, [1, 8, 8]).shape == (3, 1, 8, 8)
    assert np.array_equal(reshape(rows, [-1, 1, 8, 8]), reshape(rows, [1, 8, 8]))
    assert num_proc({"backend": SparkBackend(num_proc=3), "num_proc": None}) == 3
    assert num_proc({"backend": SparkBackend(), "num_proc": None}) is None  # the default


def test_backend_params_are_refused_before_anything_runs(digits, tmp_path):
    train, _, _ = digits
    with pytest.raises(ValueError, match='At most one of parameters "backend" and "num_proc"'):
        _conv_estimator(tmp_path, backend=SparkBackend(num_proc=2), num_proc=2).fit(train)
    with pytest.raises(ValueError, match=r"input_shapes has 2 shape\(s\) for 1 feature"):
        _conv_estimator(tmp_path, num_proc=2, input_shapes=[[-1, 64], [-1, 64]]).fit(train)
    with pytest.raises(TypeError, match="num_processes"):
        _conv_estimator(tmp_path, backend="spark")
    with pytest.raises(ValueError, match="at most one -1"):
        _conv_estimator(tmp_path, input_shapes=[[-1, -1, 8]])
