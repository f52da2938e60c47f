"""The rank side of LightningEstimator.fit: a real Lightning ``Trainer`` on each rank.

The fit starts as TorchEstimator's does (``hvd.init``, the census of every shard, the
rank's mapped shard), then hands the user's LightningModule to ``Trainer.fit`` with
strategy DDP over the job's own transport (``process_group_backend="hvs"``; ``nccl`` on
GPUs): the job set torchrun's variables, so Lightning joins the ranks that are running
and starts no process of its own.  Its ``training_step``, ``validation_step``,
``configure_optimizers`` and every hook run as under any Trainer; the batches are the
estimator's (``Batches``: this rank's shard, decoded ahead by ``decode_fn``'s threads,
as a dict of column name -> tensor).

What the estimator adds rides on one callback (``EstimatorCallback``), run on every
rank: the epoch's metrics (the training loss each step returned, the validation loss
each ``validation_step`` returned and everything the module logged, averaged over the
ranks by rows) into the history; progress and TensorBoard; rank 0's checkpoint into the
Store after every epoch (Lightning's own checkpoint, history included), which a fit
with the same ``run_id`` resumes from; early stopping and ``keep_best`` as the other
estimators decide them.  Rank 0 returns the trained module's bytes and the history.
"""
from __future__ import annotations

import io
import logging
import os
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from horovod_spark.estimator import _torch_io as tio
from horovod_spark.estimator._events import EventLog
from horovod_spark.estimator._job import (Progress, RankData, TrainSpec, append_history,
                                          averaged, fit_on_rank)
from horovod_spark.estimator._train_torch import _best_path, _share_cores
from horovod_spark.estimator.data import numeric
from horovod_spark.estimator.trainer import Watch

__all__ = ["train", "OWN_TRAINER_ARGS", "as_batch"]

#: Trainer arguments the estimator sets itself, and the param that says what they say.
OWN_TRAINER_ARGS = {
    "max_epochs": "epochs", "devices": "num_proc", "num_nodes": "num_proc",
    "accumulate_grad_batches": "backward_passes_per_step",
    "use_distributed_sampler": "the estimator's own per-rank shards",
    "enable_checkpointing": "the estimator's checkpoints (store, run_id)",
}


def train(spec: TrainSpec, directory: str) -> Optional[Dict[str, Any]]:
    import horovod_spark.torch as hvd

    return fit_on_rank(hvd, spec, directory,
                       lambda s, data, entered: _fit(hvd, s, data, directory, entered))


def as_batch(feature_cols: Sequence[str], batch: Dict[str, Any],
             transform=None) -> Dict[str, Any]:
    """The dict a LightningModule's steps get: each feature column as TorchEstimator's
    model input (float32, (rows, width); a torch sparse tensor under
    sparse_vectors="sparse"), every other numeric column as a tensor of its own dtype,
    and bytes, strings and lists as the numpy arrays they are."""
    if transform is not None:
        batch = transform(dict(batch))
    out: Dict[str, Any] = {}
    for name, value in batch.items():
        if name in feature_cols:
            out[name] = tio.to_inputs([numeric(value, name)])[0]
        elif isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
            out[name] = tio.label_tensor(value)
        else:
            out[name] = value
    return out


class Batches:
    """An epoch's batches as Lightning iterates them: `make()` gives the rank's batches
    (a fresh pass on every iter), `steps` (if known) their number on every rank."""

    def __init__(self, make, convert, steps: Optional[int] = None):
        self._make, self._convert, self._steps = make, convert, steps

    def __len__(self) -> int:
        if self._steps is None:
            raise TypeError("the validation batches have no length")
        return self._steps

    def __iter__(self):
        return (self._convert(b) for b in self._make())


def _rows(batch: Dict[str, Any], spec: TrainSpec) -> int:
    first = batch[spec.feature_cols[0]]
    return int(first.shape[0])


def _loss_of(outputs: Any):
    """The loss a step returned (a tensor, or a dict with "loss"), or None."""
    import torch

    if isinstance(outputs, dict):
        outputs = outputs.get("loss")
    return outputs.detach() if isinstance(outputs, torch.Tensor) and outputs.numel() == 1 \
        else None


def _callback_class():
    import lightning.pytorch as pl

    class EstimatorCallback(pl.Callback):
        """The estimator's side of the Trainer (see the module docstring)."""

        def __init__(self, hvd, spec: TrainSpec, steps: int, entered: float, directory: str):
            self.hvd, self.spec, self.rank = hvd, spec, hvd.rank()
            self.history: Dict[str, List[float]] = {}
            self.progress = Progress(spec, self.rank, steps, entered)
            self.events = EventLog(spec.store, spec.run_id, self.rank, spec.tensorboard,
                                   spec.log_every_n_steps)
            self.watch = Watch(spec.early_stopping, spec.keep_best, self.history) \
                if self.rank == 0 else None
            self.steps, self.directory = steps, directory
            self.stopped: Optional[int] = None
            self._sums = np.zeros(4)  # train loss * rows, train rows, val loss * rows, val rows
            self._began, self._lr = 0.0, float("nan")

        # the history rides in Lightning's checkpoint, so a resumed fit has it
        def state_dict(self) -> Dict[str, Any]:
            return {"history": self.history}

        def load_state_dict(self, state: Dict[str, Any]) -> None:
            self.history.clear()
            self.history.update(state.get("history", {}))
            if self.watch is not None:
                self.watch = Watch(self.spec.early_stopping, self.spec.keep_best, self.history)

        def on_train_epoch_start(self, trainer, module) -> None:
            self._sums[:] = 0
            self._lr = _lr(trainer)  # the rate this epoch trains with
            if self.events.active:
                self.hvd.metrics(reset=True)
            self._began = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            loss = _loss_of(outputs)
            if loss is not None:
                n = _rows(batch, self.spec)
                self._sums[0] += float(loss) * n
                self._sums[1] += n
            epoch = trainer.current_epoch
            self.progress.step_done(epoch, batch_idx, loss if loss is not None else 0.0)
            step = epoch * self.steps + batch_idx
            if loss is not None and self.events.wants_step(step):
                self.events.step(step, {"loss": float(loss), "lr": self._lr})

        def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx,
                                    dataloader_idx: int = 0) -> None:
            loss = _loss_of(outputs)
            if loss is not None and not trainer.sanity_checking:
                n = _rows(batch, self.spec)
                self._sums[2] += float(loss) * n
                self._sums[3] += n

        def on_train_epoch_end(self, trainer, module) -> None:
            epoch = trainer.current_epoch
            metrics = self._metrics(trainer, epoch)
            seconds = time.perf_counter() - self._began
            append_history(self.history, metrics)
            self.progress.epoch_done(epoch, metrics, seconds)
            if self.events.active:
                engine = self.hvd.metrics(reset=True)
                self.events.epoch(epoch, dict(
                    metrics, lr=self._lr,
                    samples_per_second=self.steps * self.spec.batch_size * self.hvd.size()
                    / max(seconds, 1e-9),
                    allreduce_share=engine.get("engine_collective_s", 0.0) / max(seconds, 1e-9)))
            best = self.watch.update(epoch, metrics) if self.watch is not None else False
            self._checkpoint(trainer, module, epoch, best)
            if self.spec.early_stopping is not None:
                stop = self.watch.stop if self.watch is not None else None
                if self.hvd.broadcast_object(stop, root_rank=0):
                    trainer.should_stop = True
                    self.stopped = epoch

        def _metrics(self, trainer, epoch: int) -> Dict[str, float]:
            """The epoch's metrics, the same on every rank: the losses the steps returned,
            weighted by rows, and what the module logged, averaged over the ranks."""
            import torch

            logged = {k: float(v) for k, v in sorted(trainer.callback_metrics.items())
                      if isinstance(v, torch.Tensor) and v.numel() == 1}
            own = self.hvd.allreduce(torch.from_numpy(self._sums.copy()), op=self.hvd.Sum,
                                     name=f"estimator.lightning.sums.{epoch}").numpy()
            metrics: Dict[str, float] = {}
            if own[1] > 0:
                metrics.update(averaged(["loss"], own[:1], own[1:2]))
            if own[3] > 0:
                metrics.update(averaged(["val_loss"], own[2:3], own[3:4]))
            names = self.hvd.broadcast_object(sorted(logged), root_rank=0)
            values = torch.tensor([logged.get(n, float("nan")) for n in names],
                                  dtype=torch.float64)
            if names:
                values = self.hvd.allreduce(values, op=self.hvd.Average,
                                            name=f"estimator.lightning.logged.{epoch}")
            for name, value in zip(names, values.tolist()):
                metrics.setdefault(name, value)
            return metrics

        def _checkpoint(self, trainer, module, epoch: int, best: bool) -> None:
            """Lightning's checkpoint of this epoch into the Store (every rank takes part in
            save_checkpoint; rank 0 writes), and the best epoch's weights."""
            import torch

            path = os.path.join(self.directory, "lightning-epoch.ckpt")
            trainer.save_checkpoint(path)
            if self.rank != 0:
                return
            with open(path, "rb") as f:
                blob = f.read()
            os.unlink(path)
            self.spec.store.save_checkpoint(self.spec.run_id, epoch, blob, self.history)
            if best:
                buf = io.BytesIO()
                torch.save({"model": module.state_dict(), "epoch": epoch}, buf)
                self.spec.store.write_bytes(_best_path(self.spec), buf.getvalue())

        def close(self) -> None:
            self.events.close()

    return EstimatorCallback


def _lr(trainer) -> float:
    try:
        return float(trainer.optimizers[0].param_groups[0]["lr"])
    except (IndexError, KeyError, AttributeError):
        return float("nan")


def _trainer(spec: TrainSpec, user: Dict[str, Any], callback) -> Any:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import DDPStrategy

    gpu = spec.use_gpu and torch.cuda.is_available()
    if spec.verbose < 2:  # Lightning's banner ("GPU available: ..."): the job says what runs
        logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    args = dict(enable_progress_bar=False, enable_model_summary=False, logger=False,
                num_sanity_val_steps=0)
    args.update(user.get("trainer_args") or {})
    args.update(
        accelerator="gpu" if gpu else "cpu",
        strategy=args.get("strategy") or DDPStrategy(
            process_group_backend="nccl" if gpu else "hvs"),
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        num_nodes=int(os.environ["GROUP_WORLD_SIZE"]), max_epochs=spec.epochs,
        accumulate_grad_batches=spec.backward_passes_per_step, use_distributed_sampler=False,
        enable_checkpointing=False, callbacks=[callback] + list(user.get("callbacks") or []))
    return pl.Trainer(**args)


def _resume_path(hvd, spec: TrainSpec, directory: str) -> Optional[str]:
    """Rank 0's read of the run's newest checkpoint, on every rank as a local file."""
    blob = None
    if hvd.rank() == 0:
        found = spec.store.latest_checkpoint(spec.run_id)
        if found is not None:
            blob = found[1]
            if spec.verbose:
                print(f"resuming run {spec.run_id!r} after epoch {found[0] + 1}", flush=True)
    blob = hvd.broadcast_object(blob, root_rank=0)
    if blob is None:
        return None
    path = os.path.join(directory, "lightning-resume.ckpt")
    with open(path, "wb") as f:
        f.write(blob)
    return path


def _fit(hvd, spec: TrainSpec, data: RankData, directory: str,
         entered: float) -> Optional[Dict[str, Any]]:
    import torch

    _share_cores(hvd.local_size())
    user = tio.loads_model(spec.user)
    data.decoding(user.get("decode_fn"), user.get("decode_workers"), hvd.local_size())
    module = user["model"]
    transform = user.get("transformation_fn")
    callback = _callback_class()(hvd, spec, data.steps, entered, directory)
    trainer = _trainer(spec, user, callback)
    convert = lambda b: as_batch(spec.feature_cols, b, transform)  # noqa: E731
    train = Batches(lambda: data.epoch(trainer.current_epoch), convert, data.steps)
    val = Batches(data.validation, convert) if spec.has_validation else None
    ckpt = _resume_path(hvd, spec, directory)
    try:
        trainer.fit(module, train, val, ckpt_path=ckpt)
    finally:
        callback.close()
    if hvd.rank() != 0:
        return None
    watch = callback.watch
    history = callback.history
    if watch.best_epoch is not None and watch.best_epoch != len(history.get("loss", [])) - 1:
        blob = spec.store.read_bytes(_best_path(spec))
        module.load_state_dict(torch.load(io.BytesIO(blob), map_location="cpu",
                                          weights_only=True)["model"])
    model_bytes = tio.dumps_model(module.cpu())
    spec.store.write_bytes(spec.store.model_path(spec.run_id), model_bytes)
    return {"model": model_bytes, "history": history, "best_epoch": watch.best_epoch,
            "stopped_epoch": callback.stopped,
            "timings": callback.progress.timings(spec.data_seconds)}
