"""KerasEstimator's callbacks on real Spark (local[2]): file writers on rank 0 alone,
averaged metrics on every rank, early stopping, Horovod's checkpoint_callback, and
rank 0's TensorBoard event file read back."""
import csv
import json
import os
import sys

import cloudpickle
import numpy as np
import pytest

keras = pytest.importorskip("keras")

from horovod_spark.estimator import KerasEstimator, LocalStore  # noqa: E402
from horovod_spark.estimator.trainer import EarlyStopping  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.tf, pytest.mark.slow]
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks can't import tests


class LogsPerRank(keras.callbacks.Callback):
    """Writes what each rank's callbacks see at each epoch's end (a callback that is not
    one of Keras's file writers runs on every rank)."""

    def __init__(self, directory):
        super().__init__()
        self.directory = directory

    def on_epoch_end(self, epoch, logs=None):
        rank = os.environ["HVS_RANK"]
        with open(os.path.join(self.directory, f"rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps({k: float(v) for k, v in logs.items()}) + "\n")


def test_file_writers_run_on_rank_0_metrics_agree_and_early_stopping_stops_both_ranks(
        digits, tmp_path):
    pytest.importorskip("tensorboardX")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train, _, _ = digits
    store = LocalStore(str(tmp_path / "store"))
    seen = tmp_path / "seen"
    seen.mkdir()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    csv_path = str(tmp_path / "epochs.csv")
    fitted = KerasEstimator(
        num_proc=2, model=model, optimizer=keras.optimizers.SGD(0.1),
        loss="sparse_categorical_crossentropy", metrics=["accuracy"],
        feature_cols=["features"], label_cols=["label"], batch_size=32, epochs=6,
        validation=0.2, store=store, run_id="keras", verbose=0,
        callbacks=[keras.callbacks.CSVLogger(csv_path), LogsPerRank(str(seen))],
        checkpoint_callback=keras.callbacks.ModelCheckpoint(
            str(tmp_path / "best.weights.h5"), save_weights_only=True, save_best_only=True,
            monitor="val_loss", mode="max"),
        early_stopping=EarlyStopping(monitor="loss", patience=1, min_delta=10.0)).fit(train)
    history = fitted.getHistory()
    assert len(history["loss"]) == 2 and history["stopped_epoch"] == [1]
    assert history["best_epoch"] == [0]  # the checkpoint callback's best, by its mode
    with open(csv_path) as f:
        assert len(list(csv.DictReader(f))) == 2  # one writer, not one per rank
    ranks = [[json.loads(line) for line in open(seen / f"rank{r}.jsonl")] for r in (0, 1)]
    assert ranks[0] == ranks[1]  # both ranks' callbacks saw the averaged metrics
    np.testing.assert_allclose([e["loss"] for e in ranks[0]], history["loss"], rtol=1e-6)
    events = EventAccumulator(store.join("runs", "keras", "logs"))
    events.Reload()
    got = {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    np.testing.assert_allclose(got["epoch/loss"], history["loss"], rtol=1e-6)
    np.testing.assert_allclose(got["epoch/val_accuracy"], history["val_accuracy"], rtol=1e-6)
    np.testing.assert_allclose(got["epoch/lr"], [0.1, 0.1], rtol=1e-6)
    assert got["step/loss"] and all(v > 0 for v in got["epoch/samples_per_second"])
