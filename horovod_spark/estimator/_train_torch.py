"""The rank side of TorchEstimator.fit: runs in each rank process.

One fit, on every rank: ``hvd.init()`` (while the task still spills the rank's
partition); the census of every shard (``_census.agree``): row counts, or the
problem every rank returns instead of training; map the rank's shard; rebuild the user's
model, optimizer and loss; rank 0 loads the run's newest checkpoint if there is
one; broadcast the epoch to start from, the parameters and, after a resume, the
optimizer state (a fresh one is the same pickle on every rank); then per
epoch: the same number of steps on every rank (``RankData.steps``), gradients
of ``backward_passes_per_step`` batches accumulated before each allreduce and
step (each scaled by 1 / that count, so the step sees their mean); the
validation rows; one allreduce of the metric sums and row counts, so every rank
records the same history; rank 0 writes the checkpoint.  Rank 0 returns the
trained model's bytes, the history and its timings; the other ranks return None.

The step's path is kept short, since a small model's step takes well under a
millisecond.  The gradients are *bucket views*: every ``.grad`` of the
optimizer's parameters is a view of one flat buffer per dtype and device
(``Gradients``), so autograd accumulates into it in place, a step averages it
with one ``hvd.allreduce_`` (what ``hvd.DistributedOptimizer`` would do with
one submission per parameter) and ``zero_`` clears it.  The loss and the
metrics stay tensors until the epoch ends (``Sums``: one host sync per
``FLUSH`` steps at most), and the progress display hears from the loop at
most every ``Progress.REPORT_EVERY`` seconds.
"""
from __future__ import annotations

import io
import importlib
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from horovod_spark.estimator import _torch_io as tio
from horovod_spark.estimator.data import numeric
from horovod_spark.estimator._events import EventLog
from horovod_spark.estimator._torch_step import Gradients, HookOptimizer, Sums
from horovod_spark.estimator.trainer import Watch, default_monitor
from horovod_spark.estimator._job import (Progress, RankData, TrainSpec, append_history,
                                          averaged, fit_on_rank)

__all__ = ["train"]


def train(spec: TrainSpec, directory: str) -> Optional[Dict[str, Any]]:
    import horovod_spark.torch as hvd

    # the first optimizer step imports torch._dynamo (seconds): do it while hvd.init
    # waits for the other ranks and the task spills
    preload = threading.Thread(target=importlib.import_module, args=("torch._dynamo",),
                               daemon=True)
    preload.start()
    return fit_on_rank(hvd, spec, directory, lambda s, data, entered: _fit(hvd, s, data, entered),
                       after_census=preload.join)


def _share_cores(local_size: int) -> None:
    """Ranks on one host split its cores, unless the user set OMP_NUM_THREADS."""
    import os

    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_size)))


def _device(use_gpu: bool):
    import torch

    return torch.device("cuda", 0) if use_gpu and torch.cuda.is_available() else \
        torch.device("cpu")


def _optimizer(optimizer: Any, model: Any):
    import torch

    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    return optimizer(model.parameters())  # a factory


class _Setup:
    """The user's objects, rebuilt on this rank."""

    def __init__(self, spec: TrainSpec):
        user = tio.loads_model(spec.user)
        self.device = _device(spec.use_gpu)
        self.put = None if self.device.type == "cpu" else self.device  # where batches go
        self.model = user["model"].to(self.device)
        self.optimizer = _optimizer(user["optimizer"], self.model)
        constructors = user.get("loss_constructors")
        loss = [make() for make in constructors] if constructors else user["loss"]
        self.losses = list(loss) if isinstance(loss, (list, tuple)) else \
            [loss] * len(spec.label_cols)
        self.loss_weights = user.get("loss_weights")
        self.label_forms = user.get("label_forms") or [None] * len(spec.label_cols)
        self.metrics = tio.metric_fns(user.get("metrics"))
        self.transform: Optional[Callable] = user.get("transformation_fn")
        self.decode: Optional[Callable] = user.get("decode_fn")
        self.decode_workers: Optional[int] = user.get("decode_workers")
        self.callbacks = list(user.get("callbacks") or [])
        self.train_hook = user.get("train_minibatch_fn")
        self.val_hook = user.get("val_minibatch_fn")
        self.compression = user.get("gradient_compression")
        scheduler = user.get("lr_scheduler")
        self.scheduler = scheduler(self.optimizer) if scheduler is not None else None
        self.per_step = user.get("lr_scheduler_interval") == "step"

    def loss_fn(self, outputs: list, labels: list, weights: Any = None):
        """Horovod's loss_fn(outputs, labels, sample_weights) of the minibatch hooks."""
        return tio.batch_loss(self.losses, outputs, labels, weights, self.loss_weights)

    def transform_outputs(self, outputs: Any, labels: list) -> Tuple[list, list]:
        """Horovod's transform_outputs: the outputs as a list, each label in the form the
        driver's dry run chose for it."""
        outputs = tio.as_outputs(outputs)
        return outputs, [tio.fit_label(t, o, form)
                         for t, o, form in zip(labels, outputs, self.label_forms)]

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])


def _fit(hvd, spec: TrainSpec, data: RankData, entered: float) -> Optional[Dict[str, Any]]:
    _share_cores(hvd.local_size())
    s = _Setup(spec)
    data.decoding(s.decode, s.decode_workers, hvd.local_size())
    rank = hvd.rank()
    start, history = _resume(hvd, spec, s, rank)
    hvd.broadcast_parameters(s.model.state_dict(), root_rank=0)
    if start > 0:  # a fresh optimizer is the same pickle on every rank: nothing to send
        hvd.broadcast_optimizer_state(s.optimizer, root_rank=0)
    grads = Gradients(s.optimizer, hvd, s.compression)
    progress = Progress(spec, rank, data.steps, entered)
    events = EventLog(spec.store, spec.run_id, rank, spec.tensorboard, spec.log_every_n_steps)
    watch = Watch(spec.early_stopping, spec.keep_best, history) if rank == 0 else None
    stopped = None
    try:
        for epoch in range(start, spec.epochs):
            if _epoch(hvd, spec, s, data, grads, progress, events, watch, history, epoch):
                stopped = epoch
                break
    finally:
        events.close()
    if rank != 0:
        return None
    if watch.best_epoch is not None and watch.best_epoch != len(history["loss"]) - 1:
        _load_best(spec, s)
    model_bytes = tio.dumps_model(s.model.cpu())
    spec.store.write_bytes(spec.store.model_path(spec.run_id), model_bytes)
    return {"model": model_bytes, "history": history, "best_epoch": watch.best_epoch,
            "stopped_epoch": stopped, "timings": progress.timings(spec.data_seconds)}


def _epoch(hvd, spec: TrainSpec, s: _Setup, data: RankData, grads: Gradients,
           progress: Progress, events: EventLog, watch: Optional[Watch],
           history: Dict[str, List[float]], epoch: int) -> bool:
    """One epoch on every rank; whether training stops after it (one rank 0 decision)."""
    names = ["loss"] + [n for n, _ in s.metrics]
    if events.active:
        hvd.metrics(reset=True)  # the share counts this epoch alone, not the setup's broadcasts
    began = time.perf_counter()
    lr = s.lr()
    train_sums = _train_epoch(spec, s, grads, data.epoch(epoch), progress, epoch, events)
    val_sums = _validate(spec, s, data) if spec.has_validation else None
    metrics = _reduce(hvd, names, train_sums, val_sums, epoch)
    seconds = time.perf_counter() - began
    append_history(history, metrics)
    progress.epoch_done(epoch, metrics, seconds)
    _step_scheduler(spec, s, metrics)
    if events.active:
        events.epoch(epoch, dict(metrics, lr=lr, **_speed(hvd, spec, data.steps, seconds)))
    if watch is not None:
        _after_epoch(spec, s, epoch, history, metrics, watch.update(epoch, metrics))
    if spec.early_stopping is None:
        return False
    return bool(hvd.broadcast_object(watch.stop if watch is not None else None, root_rank=0))


def _speed(hvd, spec: TrainSpec, steps: int, seconds: float) -> Dict[str, float]:
    """The epoch's samples per second over every rank, and its allreduce share."""
    engine = hvd.metrics(reset=True)
    return {"samples_per_second": steps * spec.batch_size * hvd.size() / max(seconds, 1e-9),
            "allreduce_share": engine.get("engine_collective_s", 0.0) / max(seconds, 1e-9)}


def _step_scheduler(spec: TrainSpec, s: _Setup, metrics: Dict[str, float]) -> None:
    import torch

    if s.scheduler is None:
        return
    if isinstance(s.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        s.scheduler.step(metrics[default_monitor(spec.has_validation)])
    elif not s.per_step:
        s.scheduler.step()


def _inputs(spec: TrainSpec, s: _Setup, batch: Dict[str, np.ndarray]):
    """(inputs, raw labels, sample weights, rows) of a batch, on the model's device."""
    if s.transform is not None:
        batch = s.transform(dict(batch))
    inputs = tio.to_inputs([numeric(batch[c], c) for c in spec.feature_cols], s.put)
    labels = [tio.label_tensor(batch[c], s.put) for c in spec.label_cols]
    weights = None
    if spec.weight_col:
        weights = tio.to_inputs([batch[spec.weight_col]], s.put)[0].reshape(-1)
    return inputs, labels, weights, len(batch[spec.feature_cols[0]])


def _plain_step(spec: TrainSpec, s: _Setup, grads: Gradients, batch, i: int):
    inputs, labels, weights, n = _inputs(spec, s, batch)
    outputs, labels = s.transform_outputs(s.model(*inputs), labels)
    loss = tio.batch_loss(s.losses, outputs, labels, weights, s.loss_weights)
    k = spec.backward_passes_per_step
    (loss / k if k > 1 else loss).backward()
    if (i + 1) % k == 0:
        grads.step()
    return outputs, labels, loss.detach(), n


def _hook_step(spec: TrainSpec, s: _Setup, optimizer: HookOptimizer, batch, i: int):
    inputs, labels, weights, n = _inputs(spec, s, batch)
    outputs, loss = s.train_hook(s.model, optimizer, s.transform_outputs, s.loss_fn, inputs,
                                 labels, weights)
    outputs, labels = s.transform_outputs(outputs, labels)
    return outputs, labels, loss.detach(), n


def _train_epoch(spec: TrainSpec, s: _Setup, grads: Gradients, batches, progress: Progress,
                 epoch: int, events: EventLog) -> np.ndarray:
    """Sums over the epoch: [loss * rows, metric * rows ..., rows]."""
    s.model.train()
    grads.attach()
    sums = Sums(len(s.metrics) + 1)
    hook = HookOptimizer(grads, spec.backward_passes_per_step) if s.train_hook else None
    first = epoch * progress.steps
    for i, batch in enumerate(batches):
        stepped = grads.steps
        if hook is None:
            outputs, labels, loss, n = _plain_step(spec, s, grads, batch, i)
        else:
            outputs, labels, loss, n = _hook_step(spec, s, hook, batch, i)
        if s.per_step and grads.steps != stepped:
            s.scheduler.step()
        sums.add([loss] + _metric_values(s, outputs, labels) if s.metrics else [loss], n)
        progress.step_done(epoch, i, loss)
        if events.wants_step(first + i):
            events.step(first + i, {"loss": float(loss), "lr": s.lr()})
    return sums.result()


def _metric_values(s: _Setup, outputs: list, labels: list) -> List[Any]:
    """Each metric of the batch, a tensor (kept on its device) or a number."""
    import torch

    values = []
    with torch.no_grad():
        for _, fn in s.metrics:
            value = fn(outputs[0], labels[0]) if len(outputs) == 1 else fn(outputs, labels)
            values.append(value.detach() if isinstance(value, torch.Tensor) else float(value))
    return values


def _validate(spec: TrainSpec, s: _Setup, data: RankData) -> np.ndarray:
    import torch

    s.model.eval()
    sums = Sums(len(s.metrics) + 1)
    with torch.no_grad():
        for batch in data.validation():
            inputs, labels, weights, n = _inputs(spec, s, batch)
            if s.val_hook is None:
                outputs, labels = s.transform_outputs(s.model(*inputs), labels)
                loss = s.loss_fn(outputs, labels, weights)
            else:
                outputs, loss = s.val_hook(s.model, s.transform_outputs, s.loss_fn, inputs,
                                           labels, weights)
                outputs, labels = s.transform_outputs(outputs, labels)
            sums.add([loss] + _metric_values(s, outputs, labels), n)
    return sums.result()


def _reduce(hvd, names: Sequence[str], train_sums: np.ndarray,
            val_sums: Optional[np.ndarray], epoch: int) -> Dict[str, float]:
    """Every rank's sums added up: the same metrics on every rank."""
    import torch

    parts = [train_sums] + ([val_sums] if val_sums is not None else [])
    total = hvd.allreduce(torch.from_numpy(np.concatenate(parts)), op=hvd.Sum,
                          name=f"estimator.metrics.{epoch}").numpy()
    width = len(names) + 1
    metrics = averaged(names, total[:width - 1], [total[width - 1]] * len(names))
    if val_sums is not None:
        val = total[width:]
        metrics.update(averaged([f"val_{n}" for n in names], val[:-1], [val[-1]] * len(names)))
    return metrics


def _after_epoch(spec: TrainSpec, s: _Setup, epoch: int, history: Dict[str, List[float]],
                 metrics: Dict[str, float], best: bool) -> None:
    """Rank 0: the checkpoint (and the best epoch's weights), then the callbacks."""
    import torch

    buf = io.BytesIO()
    state = {"model": s.model.state_dict(), "optimizer": s.optimizer.state_dict(),
             "epoch": epoch, "history": history}
    if s.scheduler is not None:
        state["scheduler"] = s.scheduler.state_dict()
    torch.save(state, buf)
    spec.store.save_checkpoint(spec.run_id, epoch, buf.getvalue(), history)
    if best:
        buf = io.BytesIO()
        torch.save({"model": s.model.state_dict(), "epoch": epoch}, buf)
        spec.store.write_bytes(_best_path(spec), buf.getvalue())
    for callback in s.callbacks:
        hook = getattr(callback, "on_epoch_end", callback)
        hook(epoch, dict(metrics))


def _best_path(spec: TrainSpec) -> str:
    return spec.store.join("runs", spec.run_id, "best.ckpt")


def _load_best(spec: TrainSpec, s: _Setup) -> None:
    import torch

    blob = spec.store.read_bytes(_best_path(spec))
    s.model.load_state_dict(torch.load(io.BytesIO(blob), map_location=s.device,
                                       weights_only=True)["model"])


def _resume(hvd, spec: TrainSpec, s: _Setup, rank: int) -> Tuple[int, Dict[str, List[float]]]:
    """(first epoch to run, history so far), from rank 0's read of the newest checkpoint."""
    import torch

    state: Tuple[int, Dict[str, List[float]]] = (0, {})
    if rank == 0:
        found = spec.store.latest_checkpoint(spec.run_id)
        if found is not None:
            epoch, blob = found
            ckpt = torch.load(io.BytesIO(blob), map_location=s.device, weights_only=True)
            try:
                s.model.load_state_dict(ckpt["model"])
                s.optimizer.load_state_dict(ckpt["optimizer"])
                if s.scheduler is not None and "scheduler" in ckpt:
                    s.scheduler.load_state_dict(ckpt["scheduler"])
            except (RuntimeError, ValueError, KeyError) as exc:
                raise ValueError(
                    f"cannot resume run {spec.run_id!r} from "
                    f"{spec.store.checkpoint_path(spec.run_id, epoch)}: the checkpoint does "
                    f"not fit this model and optimizer ({exc}); use a new run_id") from exc
            state = (epoch + 1, ckpt["history"])
            if spec.verbose:
                print(f"resuming run {spec.run_id!r} after epoch {epoch + 1}", flush=True)
    start, history = hvd.broadcast_object(state, root_rank=0)
    if start > 0 and s.scheduler is not None:  # the other ranks' schedulers catch up
        _sync_scheduler(hvd, s, rank)
    return start, history


def _sync_scheduler(hvd, s: _Setup, rank: int) -> None:
    state = hvd.broadcast_object(s.scheduler.state_dict() if rank == 0 else None, root_rank=0)
    if rank != 0:
        s.scheduler.load_state_dict(state)
