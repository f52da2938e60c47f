"""KerasEstimator's callbacks on the ranks: where the user's run, and the estimator's
own TensorBoard log, early stopping and best epoch.

The user's callbacks run after the metrics are averaged over the ranks, so every
rank sees the same numbers.  Those that write files (TensorBoard, ModelCheckpoint,
CSVLogger, BackupAndRestore, and ``checkpoint_callback``) run on rank 0 alone:
on every rank they would write one directory from several processes.
"""
from __future__ import annotations

import io
import time
from typing import Any, Dict, List, Optional

import keras
import numpy as np

from horovod_spark.estimator._events import EventLog
from horovod_spark.estimator.trainer import Watch

__all__ = ["placed", "Events", "Trainer", "FILE_WRITERS"]

FILE_WRITERS = (keras.callbacks.TensorBoard, keras.callbacks.ModelCheckpoint,
                keras.callbacks.CSVLogger, keras.callbacks.BackupAndRestore)


def placed(callbacks: List[Any], checkpoint: Any, rank: int) -> List[Any]:
    """The user's callbacks this rank runs."""
    callbacks = list(callbacks) + ([checkpoint] if checkpoint is not None else [])
    return [cb for cb in callbacks if rank == 0 or not isinstance(cb, FILE_WRITERS)]


def _lr(model) -> Optional[float]:
    try:
        return float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))
    except Exception:  # a schedule object, or an optimizer without one: not logged
        return None


class Events(keras.callbacks.Callback):
    """Rank 0's TensorBoard log: per epoch the history's metrics, the learning rate and
    the samples per second; the loss and learning rate every ``every`` steps."""

    def __init__(self, log: EventLog, steps: int, batch_size: int, size: int):
        super().__init__()
        self.log, self.steps, self.samples = log, steps, batch_size * size
        self.epoch, self.began = 0, time.perf_counter()

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch, self.began = epoch, time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        step = self.epoch * self.steps + batch
        if self.log.wants_step(step) and logs and "loss" in logs:
            self.log.step(step, {"loss": float(logs["loss"]), "lr": _lr(self.model) or 0.0})

    def on_epoch_end(self, epoch, logs=None):
        seconds = max(time.perf_counter() - self.began, 1e-9)
        values = {k: float(v) for k, v in (logs or {}).items() if np.ndim(v) == 0}
        self.log.epoch(epoch, dict(values, lr=_lr(self.model),
                                   samples_per_second=self.steps * self.samples / seconds))

    def on_train_end(self, logs=None):
        self.log.close()


class Trainer(keras.callbacks.Callback):
    """Early stopping decided by rank 0 and broadcast, so every rank stops after the same
    epoch; the best epoch's weights kept in the store and restored at the end."""

    def __init__(self, hvd, spec, history: Dict[str, List[float]], keep_best):
        super().__init__()
        self.hvd, self.spec, self.history = hvd, spec, history
        self.watch = Watch(spec.early_stopping, keep_best, history) if hvd.rank() == 0 \
            else None
        self.stopped: Optional[int] = None

    @property
    def best_epoch(self) -> Optional[int]:
        return self.watch.best_epoch if self.watch is not None else None

    def _path(self) -> str:
        return self.spec.store.join("runs", self.spec.run_id, "best.ckpt")

    def on_epoch_end(self, epoch, logs=None):
        metrics = {k: float(v) for k, v in (logs or {}).items() if np.ndim(v) == 0}
        if self.watch is not None and self.watch.update(epoch, metrics):
            buf = io.BytesIO()
            np.savez(buf, **{f"w{i}": w for i, w in enumerate(self.model.get_weights())})
            self.spec.store.write_bytes(self._path(), buf.getvalue())
        if self.spec.early_stopping is not None and self.hvd.broadcast_object(
                self.watch.stop if self.watch is not None else None, root_rank=0):
            self.model.stop_training, self.stopped = True, epoch

    def restore_best(self) -> None:
        """Rank 0: the best epoch's weights, when it is not the last."""
        best = self.best_epoch
        if best is None or best == len(self.history.get("loss", [])) - 1:
            return
        with np.load(io.BytesIO(self.spec.store.read_bytes(self._path())),
                     allow_pickle=False) as z:
            self.model.set_weights([z[f"w{i}"] for i in range(len(z.files))])
