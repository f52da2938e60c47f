"""Fixtures of the estimator tests: one local[2] SparkSession per module, digits data."""
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def spark_builder(master: str):
    """A quiet session whose executors import this checkout."""
    from pyspark.sql import SparkSession

    path = os.pathsep.join([ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    os.environ["PYTHONPATH"] = path
    return (SparkSession.builder.master(master).appName("horovod-spark-estimator-tests")
            .config("spark.pyspark.python", sys.executable)
            .config("spark.executorEnv.PYTHONPATH", path)
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "2")
            .config("spark.default.parallelism", "2"))


@pytest.fixture(scope="module")
def spark():
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        yield active
        return
    session = spark_builder("local[2]").getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="module")
def digits(spark):
    """sklearn's digits as (train_df, test_df, test numpy): 64 pixel features, 10 classes."""
    from pyspark.ml.linalg import Vectors
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.data / 16.0).astype(np.float64)
    y = data.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(y))
    x, y = x[order], y[order]
    split = int(0.8 * len(y))
    rows = [(Vectors.dense(xi), int(yi)) for xi, yi in zip(x, y)]
    train = spark.createDataFrame(rows[:split], ["features", "label"]).repartition(2).cache()
    test = spark.createDataFrame(rows[split:], ["features", "label"]).cache()
    return train, test, (x[split:], y[split:])
