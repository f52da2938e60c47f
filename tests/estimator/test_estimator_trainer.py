"""TorchEstimator's trainer features on real Spark (local[2]): early stopping agreed by
every rank, the best epoch kept, LR schedules, minibatch hooks, Horovod's parameter
names, TensorBoard event files read back, and the checks that refuse a wrong loss or
a finished run."""
import io
import sys
import warnings

import cloudpickle
import numpy as np
import pytest
import torch

from horovod_spark.estimator import LocalStore, TorchEstimator
from horovod_spark.estimator.trainer import EarlyStopping

pytestmark = [pytest.mark.spark, pytest.mark.slow]
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks can't import tests


def accuracy(output, label):
    return (output.argmax(dim=1) == label).float().mean()


def _net(outputs=10):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, outputs))


def _estimator(store, **kw):
    net = kw.pop("model", None) or _net()
    args = dict(num_proc=2, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                loss=torch.nn.CrossEntropyLoss(), metrics=[accuracy], feature_cols=["features"],
                label_cols=["label"], batch_size=32, epochs=3, store=store, verbose=0)
    args.update(kw)
    return TorchEstimator(**args)


def _scalars(store, run_id):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(store.join("runs", run_id, "logs"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def test_early_stopping_stops_every_rank_after_patience_and_the_best_epoch_is_the_model(
        digits, tmp_path):
    pytest.importorskip("tensorboardX")
    train, _, _ = digits
    store = LocalStore(str(tmp_path))
    # min_delta 10: no epoch after the first improves on it, so patience 1 stops after epoch 2;
    # keep_best in 'max' mode picks the first epoch (the highest loss) over the last one
    model = _estimator(store, epochs=6, run_id="stops", validation=0.2,
                       early_stopping=EarlyStopping(monitor="loss", patience=1, min_delta=10.0),
                       keep_best=("val_loss", "max")).fit(train)
    history = model.getHistory()
    assert len(history["loss"]) == 2 and history["stopped_epoch"] == [1]
    assert history["best_epoch"] == [0]
    best = torch.load(io.BytesIO(store.read_bytes(store.join("runs", "stops", "best.ckpt"))),
                      weights_only=True)
    assert best["epoch"] == 0
    for name, value in model.getModel().state_dict().items():
        torch.testing.assert_close(value, best["model"][name], msg=name)
    assert store.checkpoint_epochs("stops") == [0, 1]


def test_a_step_lr_schedule_and_the_metrics_reach_tensorboard_on_rank_0(digits, tmp_path):
    pytest.importorskip("tensorboardX")
    train, _, _ = digits
    store = LocalStore(str(tmp_path))
    model = _estimator(store, epochs=3, run_id="tb", validation=0.2, log_every_n_steps=5,
                       lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
                       ).fit(train)
    history = model.getHistory()
    scalars = _scalars(store, "tb")
    for name in ("loss", "accuracy", "val_loss", "val_accuracy"):
        got = [v for _, v in scalars[f"epoch/{name}"]]
        np.testing.assert_allclose(got, history[name], rtol=1e-6, err_msg=name)
    assert [s for s, _ in scalars["epoch/loss"]] == [1, 2, 3]
    np.testing.assert_allclose([v for _, v in scalars["epoch/lr"]], [0.1, 0.05, 0.025])
    steps = [s for s, _ in scalars["step/loss"]]
    assert steps[0] == 0 and all(s % 5 == 0 for s in steps) and len(steps) >= 3
    assert all(v > 0 for _, v in scalars["epoch/samples_per_second"])
    assert all(0 <= v <= 1 for _, v in scalars["epoch/allreduce_share"])
    assert len(store.listdir(store.join("runs", "tb", "logs"))) == 1  # rank 0's file alone


def hook_train(model, optimizer, transform_outputs, loss_fn, inputs, labels, sample_weights):
    optimizer.zero_grad()
    outputs, labels = transform_outputs(model(*inputs), labels)
    loss = loss_fn(outputs, labels, sample_weights)
    loss.backward()
    optimizer.step()
    return outputs, loss.detach() * 0 + 42.0  # what the history records is the hook's loss


def hook_val(model, transform_outputs, loss_fn, inputs, labels, sample_weights):
    outputs, labels = transform_outputs(model(*inputs), labels)
    return outputs, loss_fn(outputs, labels, sample_weights) * 0 + 7.0


def test_minibatch_hooks_train_with_averaged_gradients_and_report_their_losses(
        digits, tmp_path):
    train, _, _ = digits
    model = _estimator(str(tmp_path), epochs=4, validation=0.2, train_minibatch_fn=hook_train,
                       val_minibatch_fn=hook_val, tensorboard=False).fit(train)
    history = model.getHistory()
    assert history["loss"] == [42.0] * 4 and history["val_loss"] == [7.0] * 4
    assert history["val_accuracy"][-1] > 0.5  # the hook's steps trained the model (0.1: none)


def test_horovods_parameter_names_are_accepted_and_petastorm_ones_warn_once(digits, tmp_path):
    import horovod_spark.torch as hvd

    pytest.importorskip("tensorboardX")
    train, _, _ = digits
    store = LocalStore(str(tmp_path))
    est = _estimator(store, epochs=2, run_id="horovod", validation=0.2, val_batch_size=7,
                     train_steps_per_epoch=3, validation_steps_per_epoch=1,
                     gradient_compression=hvd.Compression.fp16, loss_weights=[2.0],
                     reader_pool_type="process", train_reader_num_workers=4,
                     log_every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = est.fit(train)
    ignored = [str(w.message) for w in caught if "no job here" in str(w.message)]
    assert len(ignored) == 1 and "reader_pool_type" in ignored[0] and \
        "train_reader_num_workers" in ignored[0] and "memory-maps" in ignored[0]
    assert [s for s, _ in _scalars(store, "horovod")["step/loss"]] == list(range(6))
    assert len(model.getHistory()["loss"]) == 2
    with pytest.raises(ValueError, match=r"already trained 2 epoch.*new run_id.*epochs > 2"):
        est.fit(train)  # a refit of the finished run


def test_a_class_loss_next_to_a_single_output_is_refused_with_what_to_change(digits, tmp_path):
    train, _, _ = digits
    est = _estimator(str(tmp_path), model=torch.nn.Linear(64, 1), metrics=None)
    with pytest.raises(ValueError, match=r"CrossEntropyLoss .* needs one output value per "
                                         r"class.*Linear\(64, 10\)"):
        est.fit(train)


def test_the_metrics_callbacks_get_print_as_plain_numbers():
    from horovod_spark.estimator._job import averaged

    metrics = averaged(["loss", "accuracy"], np.array([3.0, 1.5]), np.array([4.0, 2.0]))
    assert repr(metrics) == "{'loss': 0.75, 'accuracy': 0.75}"


def test_a_fit_inside_an_mlflow_run_logs_params_metrics_and_the_model(
        digits, tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    # a file: store (MLflow's client alone has no SQL store); the client's usage reports off
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    train, _, (x_test, _) = digits
    with mlflow.start_run() as run:
        model = _estimator(str(tmp_path / "store"), epochs=2, validation=0.2,
                           tensorboard=False).fit(train)
    client = mlflow.MlflowClient()
    logged = client.get_run(run.info.run_id).data
    assert (logged.params["epochs"], logged.params["batch_size"], logged.params["optimizer"],
            logged.params["loss"], logged.params["feature_cols"]) == \
        ("2", "32", "SGD", "CrossEntropyLoss", '["features"]')
    assert logged.tags["horovod_spark.run_id"] == model.getRunId()
    for name, values in model.getHistory().items():
        steps = {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
        assert steps == dict(enumerate(values)), name
    loaded = mlflow.pytorch.load_model(f"runs:/{run.info.run_id}/model")
    x = torch.from_numpy(x_test[:16].astype(np.float32))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model.getModel()(x))
