"""Horovod's own Spark estimator examples, after the import swap, run to their end.

The programs below are Horovod 0.28's `examples/spark/pytorch/pytorch_spark_mnist.py` and
`examples/spark/keras/keras_spark_mnist.py` call for call (the same Spark ML preprocessing,
model, loss, estimator arguments and evaluation), with `horovod.` renamed `horovod_spark.`
and their command-line defaults made small.  Their data is what they download, in its
format: a bzip2 libsvm file of 784 pixels a row, here made from scikit-learn's digits
(8x8, scaled to 24x24 and centred on 28x28) at the path they look for it first.
"""
from __future__ import annotations

import bz2
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import ROOT

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(420)]

ARGS = textwrap.dedent("""
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument('--num-proc', type=int, default=2)
    parser.add_argument('--batch-size', type=int, default=32)
    parser.add_argument('--epochs', type=int, default=2)
    parser.add_argument('--work-dir', default='work')
    parser.add_argument('--data-dir', default='.')
    args = parser.parse_args()
""")

COMMON = textwrap.dedent("""
    conf = SparkConf().setAppName(APP).set('spark.sql.shuffle.partitions', '16')
    conf.setMaster('local[{}]'.format(args.num_proc))
    spark = SparkSession.builder.config(conf=conf).getOrCreate()
    store = Store.create(args.work_dir)
    df = spark.read.format('libsvm').option('numFeatures', '784') \\
        .load(os.path.join(args.data_dir, 'mnist.bz2'))
    encoder = OneHotEncoder(inputCols=['label'], outputCols=['label_vec'], dropLast=False)
    train_df = encoder.fit(df).transform(df)
    train_df, test_df = train_df.randomSplit([0.9, 0.1])
""")

EVALUATE = textwrap.dedent("""
    pred_df = fitted.transform(test_df)
    argmax = udf(lambda v: float(np.argmax(v)), returnType=T.DoubleType())
    pred_df = pred_df.withColumn('label_pred', argmax(pred_df.label_prob))
    evaluator = MulticlassClassificationEvaluator(predictionCol='label_pred', labelCol='label',
                                                  metricName='accuracy')
    print('Test accuracy:', evaluator.evaluate(pred_df))
    spark.stop()
""")

IMPORTS = textwrap.dedent("""
    import os
    import sys
    import numpy as np
    import pyspark.sql.types as T
    from pyspark import SparkConf
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.ml.feature import OneHotEncoder
    from pyspark.sql import SparkSession
    from pyspark.sql.functions import udf
    from horovod_spark.spark.common.backend import SparkBackend
    from horovod_spark.spark.common.store import Store
""")

TORCH = IMPORTS + textwrap.dedent("""
    import torch.nn as nn
    import torch.nn.functional as F
    import torch.optim as optim
    import horovod_spark.spark.torch as hvd
    APP = 'pytorch_spark_mnist'
""") + ARGS + COMMON + textwrap.dedent("""
    class Net(nn.Module):
        def __init__(self):
            super(Net, self).__init__()
            self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
            self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
            self.conv2_drop = nn.Dropout2d()
            self.fc1 = nn.Linear(320, 50)
            self.fc2 = nn.Linear(50, 10)

        def forward(self, features):
            x = features.float()
            x = F.relu(F.max_pool2d(self.conv1(x), 2))
            x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
            x = x.view(-1, 320)
            x = F.relu(self.fc1(x))
            x = F.dropout(x, training=self.training)
            return F.log_softmax(self.fc2(x))

    model = Net()
    optimizer = optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    loss = nn.NLLLoss()
    backend = SparkBackend(num_proc=args.num_proc, stdout=sys.stdout, stderr=sys.stderr,
                           prefix_output_with_timestamp=True)
    estimator = hvd.TorchEstimator(backend=backend, store=store, model=model,
                                   optimizer=optimizer,
                                   loss=lambda input, target: loss(input, target.long()),
                                   input_shapes=[[-1, 1, 28, 28]], feature_cols=['features'],
                                   label_cols=['label'], batch_size=args.batch_size,
                                   epochs=args.epochs, validation=0.1,
                                   backward_passes_per_step=1, verbose=1)
    fitted = estimator.fit(train_df).setOutputCols(['label_prob'])
""") + EVALUATE

KERAS = IMPORTS + textwrap.dedent("""
    import tensorflow as tf
    from tensorflow import keras
    from tensorflow.keras.models import Sequential
    from tensorflow.keras.layers import Dense, Dropout, Flatten
    from tensorflow.keras.layers import Conv2D, MaxPooling2D
    import horovod_spark.spark.keras as hvd
    APP = 'keras_spark_mnist'
""") + ARGS + COMMON + textwrap.dedent("""
    os.environ['CUDA_VISIBLE_DEVICES'] = '-1'
    model = Sequential()
    model.add(Conv2D(32, kernel_size=(3, 3), activation='relu', input_shape=(28, 28, 1)))
    model.add(Conv2D(64, (3, 3), activation='relu'))
    model.add(MaxPooling2D(pool_size=(2, 2)))
    model.add(Dropout(0.25))
    model.add(Flatten())
    model.add(Dense(128, activation='relu'))
    model.add(Dropout(0.5))
    model.add(Dense(10, activation='softmax'))
    optimizer = keras.optimizers.Adadelta(1.0)
    loss = keras.losses.categorical_crossentropy
    backend = SparkBackend(num_proc=args.num_proc, stdout=sys.stdout, stderr=sys.stderr,
                           prefix_output_with_timestamp=True)
    estimator = hvd.KerasEstimator(backend=backend, store=store, model=model,
                                   optimizer=optimizer, loss=loss, metrics=['accuracy'],
                                   feature_cols=['features'], label_cols=['label_vec'],
                                   batch_size=args.batch_size, epochs=args.epochs,
                                   random_seed=1, inmemory_cache_all=True, verbose=1,
                                   callbacks=[keras.callbacks.TensorBoard(profile_batch=5)])
    fitted = estimator.fit(train_df).setOutputCols(['label_prob'])
""") + EVALUATE


def write_mnist_libsvm(path, rows: int = 600) -> None:
    """Digits in MNIST's libsvm layout: "label index:value ...", 1-based, 28x28 pixels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    lines = []
    for image, label in zip(digits.images[:rows] / 16.0, digits.target[:rows]):
        full = np.zeros((28, 28))
        full[2:26, 2:26] = np.kron(image, np.ones((3, 3)))
        flat = full.ravel()
        lines.append(f"{float(label)} " + " ".join(f"{i + 1}:{flat[i]:.4f}"
                                                   for i in np.nonzero(flat)[0]))
    path.write_bytes(bz2.compress(("\n".join(lines) + "\n").encode()))


def run_example(tmp_path, source: str, *args: str) -> subprocess.CompletedProcess:
    write_mnist_libsvm(tmp_path / "mnist.bz2")
    (tmp_path / "example.py").write_text(source)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HVS_", "HOROVOD_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env["PYSPARK_PYTHON"] = sys.executable
    env["JDK_JAVA_OPTIONS"] = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"  # a JVM that starts fast
    done = subprocess.run([sys.executable, "example.py", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-5000:])
    assert re.search(r"^Test accuracy: [0-9.]+$", done.stdout, re.M), done.stdout[-3000:]
    return done


def epoch_values(stdout: str, name: str) -> list:
    return [float(v) for v in re.findall(rf"epoch \d+/\d+ \(.*?\): .*?\b{name} ([0-9.]+)",
                                         stdout)]


def test_horovods_pytorch_spark_mnist_runs_to_its_end(tmp_path):
    """Scalar class indices (libsvm's doubles) next to 10 log-probabilities, NLLLoss through
    the example's lambda: the estimator's dry run refused them before."""
    pytest.importorskip("torch")
    done = run_example(tmp_path, TORCH, "--epochs", "4")
    val_loss = epoch_values(done.stdout, "val_loss")
    assert len(val_loss) == 4 and val_loss[-1] < val_loss[0], done.stdout[-3000:]


@pytest.mark.tf
def test_horovods_keras_spark_mnist_runs_to_its_end(tmp_path):
    """One-hot SparseVector labels and 784 flat pixels into Conv2D's (28, 28, 1): the model's
    own input shape, as Horovod reshapes to it."""
    pytest.importorskip("tensorflow")
    done = run_example(tmp_path, KERAS)
    accuracy = epoch_values(done.stdout, "accuracy")
    assert len(accuracy) == 2 and accuracy[-1] > accuracy[0], done.stdout[-3000:]
