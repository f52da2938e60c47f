"""Fit digits on local-cluster[2,1,1024] (two executor JVMs) and print the result as JSON.

Run by test_estimator_cluster.py in its own process, so its SparkContext is the
only one in that process.  argv: store directory.
"""
import json
import os
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]

from conftest import spark_builder  # noqa: E402

from horovod_spark.estimator import TorchEstimator  # noqa: E402


def accuracy(output, label):
    return (output.argmax(dim=1) == label).float().mean()


def main(store: str) -> None:
    import cloudpickle
    from pyspark.ml.linalg import Vectors
    from sklearn.datasets import load_digits

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    spark = spark_builder("local-cluster[2,1,1024]").getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    data = load_digits()
    order = np.random.default_rng(0).permutation(len(data.target))
    x, y = data.data[order] / 16.0, data.target[order]
    rows = [(Vectors.dense(a), int(b)) for a, b in zip(x, y)]
    train = spark.createDataFrame(rows[:1400], ["features", "label"])
    test = spark.createDataFrame(rows[1400:], ["features", "label"])
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    model = TorchEstimator(num_proc=2, model=net, optimizer=torch.optim.Adam(net.parameters(), lr=0.01),
                           loss=torch.nn.CrossEntropyLoss(), metrics=[accuracy],
                           feature_cols=["features"], label_cols=["label"], batch_size=32,
                           epochs=4, store=store, verbose=0).fit(train)
    out = model.transform(test).select("label", "label__output").collect()
    hosts = spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size()
    acc = float(np.mean([np.argmax(r.label__output.toArray()) == r.label for r in out]))
    print("RESULT " + json.dumps({"accuracy": acc, "rows": len(out), "block_managers": hosts,
                                  "history": model.getHistory()}))
    spark.stop()


if __name__ == "__main__":
    main(sys.argv[1])
