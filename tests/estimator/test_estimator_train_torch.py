"""The torch rank side without Spark: real rank processes train spilled shards.

Ranks (``collectives.launch.run_local``) each spill a shard and run
``_train_torch.train`` on it, as the barrier tasks' ranks do; the result is
checked against one process that steps on the mean gradient of every rank's
batches (what data-parallel training means), computed here with plain torch.
"""
import copy
import os
import sys

import cloudpickle
import numpy as np
import pyarrow as pa
import pytest
import torch

from collectives.launch import run_local
from horovod_spark import progress
from horovod_spark.progress import rank as progress_rank
from horovod_spark.estimator import _torch_io as tio
from horovod_spark.estimator._census import write_census
from horovod_spark.estimator._job import Progress, TrainSpec
from horovod_spark.estimator._spill import spill_partition
from horovod_spark.estimator._torch_step import FLUSH, Sums
from horovod_spark.estimator._train_torch import train
from horovod_spark.estimator.data import ColumnSpec
from horovod_spark.estimator.store import LocalStore

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks can't import tests

SPECS = (ColumnSpec("x", "feature", "array", "float32", "array<float>"),
         ColumnSpec("y", "label", "scalar", "float32", "float"))
ROWS, BATCH, EPOCHS = 64, 16, 2


def _shard_rows(rank):
    g = np.random.default_rng(10 + rank)
    x = g.normal(size=(ROWS, 3)).astype(np.float32)
    return x, (x @ np.float32([1.0, -2.0, 0.5]) + 0.3).astype(np.float32)


class TwoDtypes(torch.nn.Module):
    """float32 and float64 parameters: the gradients live in two flat buffers."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(3, 4)
        self.b = torch.nn.Linear(4, 1).double()

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)).double()).float()


def mae(output, label):  # a tensor metric
    return (output - label).abs().mean()


def largest_error(output, label):  # a plain-number metric
    return float((output - label).detach().abs().max())


def _user(net, k):
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    return {"model": net, "optimizer": opt, "loss": torch.nn.MSELoss(),
            "metrics": [mae, largest_error], "transformation_fn": None, "callbacks": None}


def _rank(base, user_bytes, k, ranks):
    rank = int(os.environ["HVS_RANK"])
    directory = os.path.join(base, f"rank{rank}")
    os.makedirs(directory)
    x, y = _shard_rows(rank)
    batch = pa.RecordBatch.from_arrays([pa.array(list(x)), pa.array(y)], names=["x", "y"])
    write_census(directory, spill_partition(iter([batch]), SPECS, rank,
                                            directory=directory).to_dict())
    spec = TrainSpec(user=user_bytes, feature_cols=("x",), label_cols=("y",), weight_col=None,
                     batch_size=BATCH, epochs=EPOCHS, shuffle=False, seed=0,
                     backward_passes_per_step=k, use_gpu=False, verbose=0,
                     store=LocalStore(os.path.join(base, "store")), run_id=f"k{k}",
                     has_validation=False, specs=SPECS, num_proc=ranks)
    out = train(spec, directory)
    if out is None:
        return None
    model = tio.loads_model(out["model"])
    return {"state": {n: t.detach().numpy() for n, t in model.state_dict().items()},
            "history": out["history"]}


def _reference(net, k, ranks):
    """One process: every k batches, a step on the mean over ranks of their gradients."""
    user = _user(net, k)
    model, opt, loss_fn = user["model"], user["optimizer"], user["loss"]
    shards = [tuple(map(torch.from_numpy, _shard_rows(r))) for r in range(ranks)]
    history = {"loss": [], "mae": [], "largest_error": []}
    steps = ROWS // BATCH
    for _ in range(EPOCHS):
        seen = {name: [] for name in history}
        for i in range(steps):
            for x, y in shards:
                xb, yb = x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]
                out = model(xb)
                loss = loss_fn(out, yb.view(-1, 1))
                (loss / (ranks * k)).backward()
                seen["loss"].append(float(loss.detach()))
                seen["mae"].append(float(mae(out, yb.view(-1, 1)).detach()))
                seen["largest_error"].append(largest_error(out, yb.view(-1, 1)))
            if (i + 1) % k == 0:
                opt.step()
                opt.zero_grad()
        for name, values in seen.items():
            history[name].append(float(np.mean(values)))
    return {n: t.detach().numpy() for n, t in model.state_dict().items()}, history


@pytest.mark.parametrize("ranks,k", [(2, 1), (2, 2), (1, 1)])
def test_ranks_train_what_one_process_gets_from_their_mean_gradient(tmp_path, ranks, k):
    net = TwoDtypes()
    want_state, want_history = _reference(copy.deepcopy(net), k, ranks)
    user_bytes = tio.dumps_model(_user(net, k))
    env = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    got = run_local(_rank, ranks, args=(str(tmp_path), user_bytes, k, ranks), env=env,
                    timeout=120)[0]
    assert set(got["state"]) == set(want_state)
    for name, value in want_state.items():
        np.testing.assert_allclose(got["state"][name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    assert set(got["history"]) == set(want_history)
    for name, values in want_history.items():
        np.testing.assert_allclose(got["history"][name], values, rtol=1e-5, err_msg=name)


def test_sums_weigh_tensors_and_numbers_by_rows_across_flushes():
    sums = Sums(2)
    rng = np.random.default_rng(0)
    values, rows = rng.normal(size=(2 * FLUSH + 7, 2)), rng.integers(1, 9, size=2 * FLUSH + 7)
    for (a, b), n in zip(values, rows):
        sums.add([torch.tensor(a, dtype=torch.float32), float(b)], int(n))
    want = [(values[:, 0].astype(np.float32).astype(np.float64) * rows).sum(),
            (values[:, 1] * rows).sum(), rows.sum()]
    np.testing.assert_allclose(sums.result(), want, rtol=1e-12)


def test_an_epoch_with_no_batches_sums_to_zero_rows():
    np.testing.assert_array_equal(Sums(2).result(), [0.0, 0.0, 0.0])


def _progress(monkeypatch, every, shown=True):
    """A rank 0 Progress of 10 steps per epoch, its records readable on fd 1."""
    if shown:
        monkeypatch.setenv("HVS_PROGRESS", "1")
    else:
        monkeypatch.delenv("HVS_PROGRESS", raising=False)
    monkeypatch.setenv("HVS_RANK", "0")
    monkeypatch.delenv("HVS_LOG_CALLBACK", raising=False)
    monkeypatch.setattr(progress_rank, "_totals", None)
    monkeypatch.setattr(progress_rank, "MIN_INTERVAL", 0.0)  # every report() becomes a record
    monkeypatch.setattr(Progress, "REPORT_EVERY", every)
    spec = TrainSpec(user=b"", feature_cols=("x",), label_cols=("y",), weight_col=None,
                     batch_size=8, epochs=2, shuffle=False, seed=0, backward_passes_per_step=1,
                     use_gpu=False, verbose=0, store=None, run_id="p", has_validation=False)
    return Progress(spec, 0, steps=10, entered=0.0)


def _records(text):
    import json

    return [json.loads(line.split(progress.PROGRESS_MARK, 1)[1]) for line in text.split("\n")
            if progress.PROGRESS_MARK in line]


def test_the_loop_reports_progress_at_most_every_interval_and_always_an_epochs_last_step(
        monkeypatch, capfd):
    p = _progress(monkeypatch, every=3600.0)
    for epoch in range(2):
        for step in range(10):
            p.step_done(epoch, step, torch.tensor(1.0 / (step + 1)))
    recs = _records(capfd.readouterr().out)
    assert [(r["epoch"], r["step"]) for r in recs] == [(0, 1), (0, 10), (1, 10)]
    assert recs[-1]["samples"] == 2 * 10 * 8  # the samples of unreported steps are not lost
    assert recs[-1]["loss"] == pytest.approx(0.1)


def test_the_loop_reports_every_step_when_the_interval_is_zero(monkeypatch, capfd):
    p = _progress(monkeypatch, every=0.0)
    for step in range(10):
        p.step_done(0, step, 0.5)
    recs = _records(capfd.readouterr().out)
    assert [r["step"] for r in recs] == list(range(1, 11))
    assert [r["samples"] for r in recs] == [8 * (i + 1) for i in range(10)]


def test_the_loop_reports_nothing_unless_the_driver_shows_progress(monkeypatch, capfd):
    p = _progress(monkeypatch, every=0.0, shown=False)
    for step in range(10):
        p.step_done(0, step, torch.tensor(float("nan")))
    assert _records(capfd.readouterr().out) == []
