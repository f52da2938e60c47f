"""Early stopping and the best epoch, as rules over a history (no Spark)."""
import pytest

from horovod_spark.estimator import EarlyStopping, TorchEstimator
from horovod_spark.estimator.trainer import Monitor, Watch


def _follow(watch, values, name="val_loss"):
    stops = []
    for epoch, value in enumerate(values):
        watch.update(epoch, {name: value})
        stops.append(watch.stop)
    return stops


def test_patience_counts_epochs_without_an_improvement_larger_than_min_delta():
    watch = Watch(EarlyStopping(patience=2, min_delta=0.1), None, {})
    # 0.95 and 0.92 improve on 1.0 by less than min_delta: the second of them stops
    assert _follow(watch, [1.0, 0.95, 0.92, 0.5]) == [False, False, True, False]


def test_patience_zero_stops_at_the_first_epoch_that_does_not_improve():
    watch = Watch(EarlyStopping(monitor="accuracy", patience=0), None, {})
    assert _follow(watch, [0.5, 0.6, 0.6], "accuracy") == [False, False, True]


def test_auto_mode_maximizes_accuracy_like_names_and_minimizes_the_rest():
    assert Monitor("val_accuracy").mode == "max" and Monitor("val_auc").mode == "max"
    assert Monitor("val_loss").mode == "min" and Monitor("mae").mode == "min"


def test_the_best_epoch_and_a_resumed_history_replay_to_the_same_state():
    history = {"val_loss": [1.0, 0.4, 0.6]}
    resumed = Watch(EarlyStopping(patience=2), ("val_loss", "auto"), history)
    assert resumed.best_epoch == 1 and not resumed.stop
    assert resumed.update(3, {"val_loss": 0.7}) is False and resumed.stop


def test_a_missing_monitored_metric_names_the_ones_there_are():
    with pytest.raises(ValueError, match=r"'val_loss' is not among .*\['loss'\].*validation"):
        Monitor("val_loss").update(0, {"loss": 1.0})


def test_early_stopping_takes_a_dict_and_refuses_unknown_keys_and_modes():
    est = TorchEstimator(early_stopping={"monitor": "loss", "patience": 3})
    assert est.getEarlyStopping() == EarlyStopping(monitor="loss", patience=3)
    with pytest.raises(TypeError, match="unknown key"):
        TorchEstimator(early_stopping={"patients": 3})
    with pytest.raises(ValueError, match="mode must be"):
        EarlyStopping(mode="lowest")
    with pytest.raises(TypeError, match="keep_best must be"):
        TorchEstimator(keep_best=3)
