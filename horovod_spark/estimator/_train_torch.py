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
import dataclasses
import importlib
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from horovod_spark.estimator import _torch_io as tio
from horovod_spark.estimator._census import agree
from horovod_spark.estimator._torch_step import Gradients, Sums
from horovod_spark.estimator._job import (Progress, RankData, TrainSpec, append_history,
                                          averaged)

__all__ = ["train"]


def train(spec: TrainSpec, directory: str) -> Optional[Dict[str, Any]]:
    import horovod_spark.torch as hvd

    entered = time.time()
    # the first optimizer step imports torch._dynamo (seconds): do it while hvd.init
    # waits for the other ranks and the task spills
    preload = threading.Thread(target=importlib.import_module, args=("torch._dynamo",),
                               daemon=True)
    preload.start()
    hvd.init()
    spec = dataclasses.replace(spec, stamps=spec.stamps + (("initialized", time.time()),))
    problem, spec = agree(hvd.allgather_object, spec, directory)
    preload.join()
    if problem is not None:
        return {"problem": problem} if hvd.rank() == 0 else None
    _share_cores(hvd.local_size())
    data = RankData(spec, directory, hvd.rank())
    try:
        return _fit(hvd, spec, data, entered)
    finally:
        data.close()


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
        loss = user["loss"]
        self.losses = list(loss) if isinstance(loss, (list, tuple)) else \
            [loss] * len(spec.label_cols)
        self.metrics = tio.metric_fns(user.get("metrics"))
        self.transform: Optional[Callable] = user.get("transformation_fn")
        self.callbacks = list(user.get("callbacks") or [])


def _fit(hvd, spec: TrainSpec, data: RankData, entered: float) -> Optional[Dict[str, Any]]:
    s = _Setup(spec)
    rank = hvd.rank()
    start, history = _resume(hvd, spec, s, rank)
    hvd.broadcast_parameters(s.model.state_dict(), root_rank=0)
    if start > 0:  # a fresh optimizer is the same pickle on every rank: nothing to send
        hvd.broadcast_optimizer_state(s.optimizer, root_rank=0)
    grads = Gradients(s.optimizer, hvd)
    progress = Progress(spec, rank, data.steps, entered)
    names = ["loss"] + [n for n, _ in s.metrics]
    for epoch in range(start, spec.epochs):
        began = time.perf_counter()
        train_sums = _train_epoch(spec, s, grads, data.epoch(epoch), progress, epoch)
        val_sums = _validate(spec, s, data) if spec.has_validation else None
        metrics = _reduce(hvd, names, train_sums, val_sums, epoch)
        append_history(history, metrics)
        progress.epoch_done(epoch, metrics, time.perf_counter() - began)
        if rank == 0:
            _after_epoch(spec, s, epoch, history, metrics)
    if rank != 0:
        return None
    model_bytes = tio.dumps_model(s.model.cpu())
    spec.store.write_bytes(spec.store.model_path(spec.run_id), model_bytes)
    return {"model": model_bytes, "history": history,
            "timings": progress.timings(spec.data_seconds)}


def _batch_tensors(spec: TrainSpec, s: _Setup, batch: Dict[str, np.ndarray]):
    if s.transform is not None:
        batch = s.transform(dict(batch))
    inputs = tio.to_inputs([batch[c] for c in spec.feature_cols], s.put)
    outputs = tio.as_outputs(s.model(*inputs))
    labels = [tio.shape_label(batch[c], o, s.put) for c, o in zip(spec.label_cols, outputs)]
    weights = None
    if spec.weight_col:
        weights = tio.to_inputs([batch[spec.weight_col]], s.put)[0].reshape(-1)
    return outputs, labels, weights, len(batch[spec.feature_cols[0]])


def _train_epoch(spec: TrainSpec, s: _Setup, grads: Gradients, batches, progress: Progress,
                 epoch: int) -> np.ndarray:
    """Sums over the epoch: [loss * rows, metric * rows ..., rows]."""
    s.model.train()
    grads.attach()
    k = spec.backward_passes_per_step
    sums = Sums(len(s.metrics) + 1)
    for i, batch in enumerate(batches):
        outputs, labels, weights, n = _batch_tensors(spec, s, batch)
        loss = tio.batch_loss(s.losses, outputs, labels, weights)
        (loss / k if k > 1 else loss).backward()
        if (i + 1) % k == 0:
            grads.step()
        loss = loss.detach()
        sums.add([loss] + _metric_values(s, outputs, labels) if s.metrics else [loss], n)
        progress.step_done(epoch, i, loss)
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
        for batch in data.validation(spec.batch_size):
            outputs, labels, weights, n = _batch_tensors(spec, s, batch)
            loss = tio.batch_loss(s.losses, outputs, labels, weights)
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
                 metrics: Dict[str, float]) -> None:
    import torch

    buf = io.BytesIO()
    torch.save({"model": s.model.state_dict(), "optimizer": s.optimizer.state_dict(),
                "epoch": epoch, "history": history}, buf)
    spec.store.save_checkpoint(spec.run_id, epoch, buf.getvalue(), history)
    for callback in s.callbacks:
        hook = getattr(callback, "on_epoch_end", callback)
        hook(epoch, dict(metrics))


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
            except (RuntimeError, ValueError, KeyError) as exc:
                raise ValueError(
                    f"cannot resume run {spec.run_id!r} from "
                    f"{spec.store.checkpoint_path(spec.run_id, epoch)}: the checkpoint does "
                    f"not fit this model and optimizer ({exc}); use a new run_id") from exc
            state = (epoch + 1, ckpt["history"])
            if spec.verbose:
                print(f"resuming run {spec.run_id!r} after epoch {epoch + 1}", flush=True)
    return hvd.broadcast_object(state, root_rank=0)
