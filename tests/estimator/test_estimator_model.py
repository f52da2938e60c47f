"""TorchModel without training: transform on the executors, output types, persistence."""
import sys

import cloudpickle
import numpy as np
import pytest
import torch

from horovod_spark.estimator import TorchModel

pytestmark = pytest.mark.spark
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the executors can't import tests


@pytest.fixture(scope="module")
def df(spark):
    from pyspark.ml.linalg import Vectors

    x = np.random.default_rng(1).normal(size=(60, 3))
    rows = [(Vectors.dense(r), [float(v) for v in r], float(r[0]), int(i % 4)) for i, r in enumerate(x)]
    return spark.createDataFrame(rows, ["vec", "arr", "scalar", "label"]).repartition(3)


def _expected(net, rows, col):
    x = np.array([r[col].toArray() if hasattr(r[col], "toArray") else r[col] for r in rows],
                 dtype=np.float32)
    with torch.no_grad():
        return net(torch.from_numpy(x)).numpy()


def test_a_scalar_output_is_a_double_column_equal_to_torch(df):
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    out = TorchModel.from_module(net, feature_cols=["vec"], label_cols=["scalar"]).transform(df)
    assert dict(out.dtypes)["scalar__output"] == "double"
    rows = out.collect()
    np.testing.assert_allclose([r["scalar__output"] for r in rows],
                               _expected(net, rows, "vec")[:, 0], rtol=1e-6)


def test_a_vector_output_is_an_ml_vector_equal_to_torch(df):
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Softmax(dim=1))
    model = TorchModel.from_module(net, feature_cols=["arr"], label_cols=["label"],
                                   output_cols=["probability"])
    out = model.transform(df)
    assert dict(out.dtypes)["probability"] == "vector"
    rows = out.collect()
    np.testing.assert_allclose(np.array([r.probability.toArray() for r in rows]),
                               _expected(net, rows, "arr"), rtol=1e-5)
    assert set(out.columns) == {"vec", "arr", "scalar", "label", "probability"}


def test_scalar_feature_columns_each_become_one_input(df):
    class Two(torch.nn.Module):
        def forward(self, a, b):
            return a * 2 + b

    out = TorchModel.from_module(Two(), feature_cols=["scalar", "scalar"],
                                 label_cols=["y"]).transform(df).collect()
    np.testing.assert_allclose([r["y__output"] for r in out], [3 * r.scalar for r in out],
                               rtol=1e-6)


class CountingLinear(torch.nn.Linear):
    """Appends a line to ``log`` each time it is unpickled."""

    def __init__(self, log):
        super().__init__(3, 1)
        self.log = log

    def __setstate__(self, state):
        super().__setstate__(state)
        with open(self.log, "a") as f:
            f.write("load\n")


def test_the_model_loads_once_per_partition_not_per_batch(spark, df, tmp_path):
    log = str(tmp_path / "loads")
    model = TorchModel(model_bytes=cloudpickle.dumps(CountingLinear(log)), output_shapes=[[]],
                       feature_cols=["vec"], label_cols=["y"], batch_size=4)
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "5")
    try:
        assert model.transform(df).count() == 60 and \
            model.transform(df).select("y__output").collect()
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    with open(log) as f:
        loads = f.read().split()
    assert len(loads) == df.rdd.getNumPartitions()


def test_save_load_and_transform_give_the_same_predictions(df, tmp_path):
    net = torch.nn.Linear(3, 2)
    model = TorchModel.from_module(net, feature_cols=["vec"], label_cols=["label"])
    model._history = {"loss": [1.0, 0.5]}
    path = str(tmp_path / "model")
    model.write().overwrite().save(path)
    loaded = TorchModel.load(path)
    assert loaded.uid == model.uid and loaded.getFeatureCols() == ["vec"]
    assert loaded.getHistory() == {"loss": [1.0, 0.5]}
    a = [r["label__output"].toArray() for r in model.transform(df).orderBy("scalar").collect()]
    b = [r["label__output"].toArray() for r in loaded.transform(df).orderBy("scalar").collect()]
    np.testing.assert_array_equal(a, b)


def test_a_pipeline_model_with_the_model_saves_and_loads(df, tmp_path):
    from pyspark.ml import PipelineModel
    from pyspark.ml.feature import VectorAssembler

    assembler = VectorAssembler(inputCols=["scalar", "scalar"], outputCol="pair")
    net = torch.nn.Linear(2, 1)
    pipeline = PipelineModel([assembler, TorchModel.from_module(net, feature_cols=["pair"],
                                                                label_cols=["y"])])
    pipeline.write().overwrite().save(str(tmp_path / "pipeline"))
    rows = PipelineModel.load(str(tmp_path / "pipeline")).transform(df).collect()
    np.testing.assert_allclose([r["y__output"] for r in rows], _expected(net, rows, "pair")[:, 0],
                               rtol=1e-6)


def test_transform_names_a_missing_feature_column(df):
    model = TorchModel.from_module(torch.nn.Linear(3, 1), feature_cols=["vector"],
                                   label_cols=["y"])
    with pytest.raises(ValueError, match=r"\['vector'\] not in the DataFrame; its columns are"):
        model.transform(df)


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scalar, self.vector = torch.nn.Linear(3, 1), torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.scalar(x), self.vector(x)


def test_a_model_with_two_outputs_fills_one_column_per_label(df):
    torch.manual_seed(2)
    net = TwoHeads()
    out = TorchModel.from_module(net, feature_cols=["vec"], label_cols=["scalar", "label"]) \
        .transform(df)
    assert dict(out.dtypes)["scalar__output"] == "double"
    assert dict(out.dtypes)["label__output"] == "vector"
    rows = out.collect()
    x = torch.tensor(np.array([r.vec.toArray() for r in rows]), dtype=torch.float32)
    with torch.no_grad():
        a, b = net(x)
    np.testing.assert_allclose([r.scalar__output for r in rows], a.numpy()[:, 0], rtol=1e-6)
    np.testing.assert_allclose([r.label__output.toArray() for r in rows], b.numpy(), rtol=1e-6)
