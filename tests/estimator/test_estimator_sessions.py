"""TorchEstimator in a Pipeline written once, run on a classic local[2] session and on a
Spark Connect one (a client of the real local server of tests/connect_server.py): fit,
transform, save, load, the same predictions after the load, and a failing rank named;
KerasEstimator's fit and transform on Connect."""
import sys

import cloudpickle
import numpy as np
import pytest
import torch

from connect_server import connect_mode
from horovod_spark import JobFailedError
from horovod_spark.estimator import KerasEstimator, TorchEstimator, TorchModel

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks can't import tests


@pytest.fixture(params=["classic", "connect"])
def session(request, spark):
    """The classic session of this module (conftest's), or the Connect client, with the
    process in the user's Connect mode (Spark ML's own stages then run through Connect)."""
    if request.param == "classic":
        yield spark
        return
    remote = request.getfixturevalue("connect_server").session()
    with connect_mode():
        yield remote


def _data(session):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 3))
    y = x @ np.array([1.0, -2.0, 0.5]) + 0.25
    rows = [tuple(map(float, r)) + (float(t),) for r, t in zip(x, y)]
    return session.createDataFrame(rows, ["a", "b", "c", "y"])


def _estimator(store, **kw):
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    args = dict(num_proc=2, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                loss=torch.nn.MSELoss(), feature_cols=["features"], label_cols=["y"],
                batch_size=16, epochs=6, store=store, verbose=0)
    args.update(kw)
    return TorchEstimator(**args)


def _assembler(session):
    """The stage that makes the features column: Spark ML's VectorAssembler, or, where its
    Java stages cannot run (a Connect client before pyspark 4, whose Spark ML needs a JVM),
    a SQL array of the same three columns."""
    import pyspark
    from pyspark.ml import Transformer
    from pyspark.ml.feature import VectorAssembler

    if not _is_connect(session) or int(pyspark.__version__.split(".")[0]) >= 4:
        return VectorAssembler(inputCols=["a", "b", "c"], outputCol="features")

    class ArrayAssembler(Transformer):
        def _transform(self, df):
            from pyspark.sql import functions as F
            return df.withColumn("features", F.array("a", "b", "c"))

    return ArrayAssembler()


def _is_connect(session):
    return type(session).__module__.startswith("pyspark.sql.connect")


def test_a_pipeline_fits_transforms_saves_and_loads(session, tmp_path):
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.feature import VectorAssembler

    df, assembler = _data(session), _assembler(session)
    if isinstance(assembler, VectorAssembler):
        stages = [assembler, _estimator(str(tmp_path / "store"))]
    else:  # pyspark 3.5's Spark ML saves no Pipeline without a JVM: our model alone
        df, stages = assembler.transform(df), [_estimator(str(tmp_path / "store"))]
    fitted = Pipeline(stages=stages).fit(df)
    if isinstance(assembler, VectorAssembler):
        fitted.write().overwrite().save(str(tmp_path / "pipeline"))
        loaded = PipelineModel.load(str(tmp_path / "pipeline"))
    else:
        fitted = fitted.stages[-1]
        fitted.write().overwrite().save(str(tmp_path / "model"))
        loaded = TorchModel.load(str(tmp_path / "model"))
    before = fitted.transform(df).orderBy("a").select("y", "y__output").collect()
    after = loaded.transform(df).orderBy("a").select("y__output").collect()
    assert len(before) == 400
    assert [r.y__output for r in before] == [r.y__output for r in after]
    pred, truth = np.array([r.y__output for r in before]), np.array([r.y for r in before])
    assert np.sqrt(np.mean((pred - truth) ** 2)) < 0.1 * truth.std()


def _fails_on_rank_1(output, label):
    import os

    if os.environ.get("HVS_RANK") == "1":
        raise ValueError("metric cannot be computed on rank 1")
    return (output - label).abs().mean()


def test_an_error_in_training_on_rank_1_is_named_with_its_traceback(session, tmp_path):
    df = _assembler(session).transform(_data(session))
    with pytest.raises(JobFailedError) as info:
        _estimator(str(tmp_path / "store"), metrics=[_fails_on_rank_1], epochs=1).fit(df)
    err = info.value
    assert (err.rank, err.error_type) == (1, "ValueError")
    assert "metric cannot be computed on rank 1" in err.remote_traceback
    assert "see the executor's log" not in str(err)


@pytest.mark.tf
@pytest.mark.slow
def test_a_keras_estimator_fits_and_transforms_on_connect(connect_server, tmp_path):
    """KerasEstimator through the same Connect path (kept small: each rank starts TensorFlow)."""
    keras = pytest.importorskip("keras")
    from pyspark.ml.feature import VectorAssembler

    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    session = connect_server.session()
    with connect_mode():
        df = VectorAssembler(inputCols=["a", "b", "c"], outputCol="features").transform(
            _data(session))
        model = KerasEstimator(num_proc=2, model=net, optimizer=keras.optimizers.SGD(0.05),
                               loss="mse", feature_cols=["features"], label_cols=["y"],
                               batch_size=32, epochs=2, store=str(tmp_path / "store"),
                               verbose=0).fit(df)
        rows = model.transform(df).select("features", "y", "y__output").collect()
    assert len(rows) == 400 and len(model.getHistory()["loss"]) == 2
    x = np.array([r.features.toArray() for r in rows], np.float32)
    want = model.getModel().predict_on_batch(x).reshape(-1)
    np.testing.assert_allclose([r.y__output for r in rows], want, rtol=1e-5, atol=1e-5)
    loss = np.mean((want - np.array([r.y for r in rows])) ** 2)
    assert loss < np.var([r.y for r in rows])  # it learned something in two epochs
