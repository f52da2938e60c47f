"""LightningEstimator on real Spark (local[2]) with a real Lightning Trainer on each rank:
a LightningModule's training_step, validation_step, configure_optimizers (a schedule)
and self.log drive the fit; the estimator's history, TensorBoard files, MLflow run,
checkpoints (a resumed run_id), early stopping and the best epoch; a user's Lightning
callback on every rank; a rank that raises is named; the driver's refusals; Horovod's
module path horovod_spark.spark.lightning."""
import os
import sys

import cloudpickle
import numpy as np
import pytest
import torch

L = pytest.importorskip("lightning.pytorch")

from horovod_spark.estimator import EarlyStopping, LightningEstimator, LocalStore  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.slow]
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks can't import tests


class Digits(L.LightningModule):
    def __init__(self, lr=0.01, flat_metric=False):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 10))
        self.lr, self.flat_metric = lr, flat_metric

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        out = self(batch["features"])
        loss = torch.nn.functional.cross_entropy(out, batch["label"])
        self.log("train_acc", (out.argmax(1) == batch["label"]).float().mean(),
                 on_step=False, on_epoch=True)
        if self.flat_metric:
            self.log("flat", 1.0, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        out = self(batch["features"])
        self.log("val_acc", (out.argmax(1) == batch["label"]).float().mean())
        return torch.nn.functional.cross_entropy(out, batch["label"])

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        return {"optimizer": opt,
                "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}


class Recorder(L.Callback):
    """Writes what each rank saw at each epoch's end into `where`."""

    def __init__(self, where):
        self.where = where

    def on_train_epoch_end(self, trainer, module):
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        with open(os.path.join(self.where, f"rank{trainer.global_rank}"), "a") as f:
            f.write(f"{trainer.current_epoch} {trainer.world_size} {lr}\n")


def _estimator(store, **kw):
    args = dict(num_proc=2, model=Digits(), feature_cols=["features"], label_cols=["label"],
                batch_size=32, epochs=3, store=store, verbose=0, validation=0.2)
    args.update(kw)
    return LightningEstimator(**args)


def _seen(where):
    return {name: [line.split() for line in open(os.path.join(where, name))]
            for name in sorted(os.listdir(where))}


def test_a_lightning_module_trains_predicts_and_reaches_tensorboard_and_mlflow(
        digits, tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    pytest.importorskip("tensorboardX")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    train, test, (x_test, y_test) = digits
    seen = tmp_path / "seen"
    seen.mkdir()
    store = LocalStore(str(tmp_path / "store"))
    with mlflow.start_run() as run:
        model = _estimator(store, run_id="lt", callbacks=[Recorder(str(seen))],
                           log_every_n_steps=5, trainer_args={"gradient_clip_val": 5.0}
                           ).fit(train)
    history = model.getHistory()
    for name in ("loss", "val_loss", "train_acc", "val_acc"):
        assert len(history[name]) == 3, (name, history)
    assert history["loss"][-1] < history["loss"][0]
    # the schedule of configure_optimizers stepped each epoch, on both ranks' Trainers
    # (Lightning steps it before the callbacks' on_train_epoch_end)
    assert _seen(str(seen)) == {f"rank{r}": [["0", "2", "0.005"], ["1", "2", "0.0025"],
                                             ["2", "2", "0.00125"]] for r in (0, 1)}
    predicted = model.transform(test).select("label__output").toPandas()
    accuracy = np.mean(np.stack(predicted["label__output"].to_list()).argmax(1) == y_test)
    assert accuracy > 0.8, (accuracy, history)
    # the model is the trained module, forward as transform used it
    module = model.getModel()
    assert isinstance(module, L.LightningModule)
    with torch.no_grad():
        out = module(torch.from_numpy(x_test[:4].astype(np.float32))).numpy()
    np.testing.assert_allclose(out, np.stack(predicted["label__output"].to_list()[:4]),
                               rtol=1e-5, atol=1e-5)
    events = EventAccumulator(store.join("runs", "lt", "logs"))
    events.Reload()
    for name in ("loss", "val_loss", "val_acc"):
        got = [e.value for e in events.Scalars(f"epoch/{name}")]
        np.testing.assert_allclose(got, history[name], rtol=1e-6, err_msg=name)
    assert [e.step for e in events.Scalars("step/loss")][:2] == [0, 5]
    # the learning rate each epoch trained with
    np.testing.assert_allclose([e.value for e in events.Scalars("epoch/lr")], [0.01, 0.005, 0.0025])
    client = mlflow.MlflowClient()
    for name in ("loss", "val_acc"):
        steps = {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
        assert steps == dict(enumerate(history[name])), name
    assert store.checkpoint_epochs("lt") == [1, 2]  # the store keeps the newest two


def test_a_run_id_resumes_from_lightnings_checkpoint_in_the_store(digits, tmp_path):
    train, _, _ = digits
    store = LocalStore(str(tmp_path / "store"))
    seen = tmp_path / "seen"
    seen.mkdir()
    first = _estimator(store, run_id="again", epochs=2).fit(train)
    again = _estimator(store, run_id="again", epochs=3,
                       callbacks=[Recorder(str(seen))]).fit(train)
    # one more epoch ran, from the checkpoint's weights, optimizer and schedule
    assert _seen(str(seen)) == {f"rank{r}": [["2", "2", "0.00125"]] for r in (0, 1)}
    history = again.getHistory()
    assert history["loss"][:2] == first.getHistory()["loss"] and len(history["loss"]) == 3
    assert store.checkpoint_epochs("again") == [1, 2]


def test_early_stopping_on_a_logged_metric_and_the_best_epoch_is_the_model(digits, tmp_path):
    train, _, _ = digits
    store = LocalStore(str(tmp_path / "store"))
    # "flat" never improves: patience 0 stops every rank's Trainer after the second epoch;
    # keep_best on val_loss in 'max' mode picks the first epoch's weights
    model = _estimator(store, run_id="stop", epochs=5, model=Digits(flat_metric=True),
                       early_stopping=EarlyStopping(monitor="flat", patience=0),
                       keep_best=("val_loss", "max")).fit(train)
    history = model.getHistory()
    assert history["flat"] == [1.0, 1.0] and history["stopped_epoch"] == [1]
    assert history["best_epoch"] == [0]
    best = torch.load(store.join("runs", "stop", "best.ckpt"), weights_only=True)
    for name, value in model.getModel().state_dict().items():
        torch.testing.assert_close(value, best["model"][name], msg=name)


class FailsOnRank1(Digits):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == 2:
            raise ValueError("bad batch on rank 1")
        return super().training_step(batch, batch_idx)


def test_a_rank_that_raises_in_training_step_is_named_with_its_traceback(digits, tmp_path):
    from horovod_spark import JobFailedError

    train, _, _ = digits
    with pytest.raises(JobFailedError) as err:
        _estimator(str(tmp_path), model=FailsOnRank1(), validation=None).fit(train)
    text = str(err.value)
    assert "rank 1" in text and "ValueError: bad batch on rank 1" in text
    assert "training_step" in text


class NoForward(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(64, 10)

    def training_step(self, batch, batch_idx):
        return self.net(batch["features"]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_driver_refuses_what_a_lightning_module_cannot_take(digits, tmp_path):
    train, _, _ = digits
    with pytest.raises(ValueError, match="optimizer= is for TorchEstimator.*"
                                         "configure_optimizers"):
        _estimator(str(tmp_path), optimizer=lambda p: torch.optim.SGD(p, lr=1)).fit(train)
    with pytest.raises(TypeError, match="LightningModule.*use TorchEstimator"):
        _estimator(str(tmp_path), model=torch.nn.Linear(64, 10)).fit(train)
    with pytest.raises(ValueError, match=r"trainer_args\['max_epochs'\].*epochs"):
        _estimator(str(tmp_path), trainer_args={"max_epochs": 3})
    with pytest.raises(ValueError, match="NoForward has no forward"):
        _estimator(str(tmp_path), model=NoForward()).fit(train)
    with pytest.raises(ValueError, match="1 outputs for 2 label columns"):
        _estimator(str(tmp_path), label_cols=["label", "label"]).fit(train)
    with pytest.raises(TypeError, match="lightning.pytorch.Callback"):
        _estimator(str(tmp_path), callbacks=[lambda epoch, metrics: None]).fit(train)


def test_horovods_module_path_is_the_lightning_estimator():
    import horovod_spark.spark.lightning as hl
    from horovod_spark.estimator import lightning_estimator

    assert hl is lightning_estimator
    assert hl.TorchEstimator is LightningEstimator and hl.TorchModel.__name__ == "TorchModel"
