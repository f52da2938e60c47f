"""Keras 3 callbacks of Horovod: broadcast the start state, average metrics, and
schedule the learning rate (warmup for large global batches).

Learning-rate schedule terms: the *multiplier* maps a (possibly fractional)
epoch to a factor of `initial_lr`; *staircase* changes the rate once per epoch,
otherwise at every batch.  *Momentum correction* (Goyal et al., 2017): the
velocity of momentum optimizers carries the old rate, so when the rate changes
by new/old the velocity is scaled by new/old too.  Keras 3 bakes `momentum`
into the compiled train step, so the correction scales the velocity slots
themselves, which is what changing momentum for one step amounts to.
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import keras
import numpy as np

from collectives import MismatchError
from collectives.errors import describe

from .. import tensorflow as hvd_tf
from ..tensorflow.functions import allgather_object, broadcast_variables
from ..tensorflow.mpi_ops import Average, allreduce

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback", "BestModelCheckpoint"]


def _is_seed_state(v) -> bool:
    return str(getattr(v, "path", "")).endswith("seed_generator_state")


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Start every rank from root_rank's model and optimizer state.

    The model's weights go when training begins, if the model is built by then
    (it is when it was made with keras.Input or called once), so the first step
    already starts from root's weights.  The TensorFlow backend builds the
    optimizer (and an unbuilt model) inside the first step, so what was not
    there at the start goes after the first batch, as in Horovod.  The state
    of random layers (Keras 3 seed generators: dropout, noise) stays per rank,
    so ranks keep drawing different dropout masks, as they do under Horovod.
    `local_variables` (those of a PartialDistributedOptimizer's local layers) stay
    as each rank has them.
    """

    def __init__(self, root_rank: int = 0, device: str = "", local_variables=None) -> None:
        super().__init__()
        self.root_rank = int(root_rank)
        self._local = {id(v) for v in (local_variables or [])}
        self._model_done = False
        self._optimizer_done = False

    def _broadcast(self) -> None:
        if not self._model_done and self.model.built and self.model.variables:
            broadcast_variables([v for v in self.model.variables
                                 if not _is_seed_state(v) and id(v) not in self._local],
                                self.root_rank)
            self._model_done = True
        opt = getattr(self.model, "optimizer", None)
        if not self._optimizer_done and opt is not None and opt.built:
            broadcast_variables(opt.variables, self.root_rank)
            self._optimizer_done = True

    def on_train_begin(self, logs=None):
        self._model_done = self._optimizer_done = False  # every fit() starts in sync
        self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        if not (self._model_done and self._optimizer_done):
            self._broadcast()


class MetricAverageCallback(keras.callbacks.Callback):
    """Average the epoch's metrics (and validation metrics) over ranks, in place.

    Put it before callbacks that read the metrics (checkpoints, early stopping).
    """

    def __init__(self, device: str = "") -> None:
        super().__init__()

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        everyone = allgather_object(keys, name="MetricAverageCallback.keys")
        if any(k != keys for k in everyone):
            detail = "; ".join(f"rank {r}: {k}" for r, k in enumerate(everyone))
            raise MismatchError(describe(f"ranks log different metrics ({detail})",
                                         rank=hvd_tf.rank(), size=hvd_tf.size(),
                                         op="MetricAverageCallback"))
        values = np.array([float(logs[k]) for k in keys], np.float64)
        mean = np.asarray(allreduce(values, op=Average, name="MetricAverageCallback"))
        for k, v in zip(keys, mean):
            logs[k] = float(v)


def _get_lr(opt) -> float:
    return float(keras.ops.convert_to_numpy(opt.learning_rate))


def _momentum_slots(opt) -> list:
    opt = getattr(opt, "inner_optimizer", opt)  # a LossScaleOptimizer's momentum is its inner's
    if not float(getattr(opt, "momentum", 0.0) or 0.0):
        return []
    return list(getattr(opt, "momentums", None) or getattr(opt, "_momentums", None) or [])


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """lr = initial_lr * multiplier(epoch) between start_epoch and end_epoch.

    Args:
        initial_lr: the rate the multiplier scales (default: the optimizer's at train begin).
        multiplier: a number, or a function of the epoch (fractional unless staircase).
        staircase: adjust at the first batch of each epoch; else at every batch.
        momentum_correction: scale momentum velocity with the rate (see the module doc).
        steps_per_epoch: batches per epoch (default: what model.fit reports).
    """

    def __init__(self, initial_lr: Optional[float] = None,
                 multiplier: Union[float, Callable[[float], float]] = 1.0, start_epoch: int = 0,
                 end_epoch: Optional[int] = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: Optional[int] = None) -> None:
        super().__init__()
        self.initial_lr = initial_lr
        self.staircase = bool(staircase) or not callable(multiplier)
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0

    def _detect_steps(self) -> int:
        steps = (self.params or {}).get("steps")
        if not steps:
            raise ValueError(f"{type(self).__name__}: cannot tell the number of steps per epoch "
                             "(model.fit did not report it); pass steps_per_epoch")
        return int(steps)

    def on_train_begin(self, logs=None):
        if self.initial_lr is None:
            self.initial_lr = _get_lr(self.model.optimizer)
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._detect_steps()

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def _in_scope(self) -> bool:
        e = self.current_epoch
        return e >= self.start_epoch and (self.end_epoch is None or e < self.end_epoch)

    def _set_lr(self, epoch: float) -> None:
        opt = self.model.optimizer
        old, new = _get_lr(opt), float(self.initial_lr * self.multiplier(epoch))
        if new == old:
            return
        opt.learning_rate = new
        if self.momentum_correction and old != 0.0:
            for slot in _momentum_slots(opt):
                slot.assign(slot * (new / old))

    def on_train_batch_begin(self, batch, logs=None):
        if not self._in_scope():
            return
        if not self.staircase:
            self._set_lr(self.current_epoch + float(batch) / self.steps_per_epoch)
        elif batch == 0:
            self._set_lr(self.current_epoch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["learning_rate"] = _get_lr(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the rate from initial_lr / size to initial_lr over warmup_epochs (Goyal et al.).

    A large global batch (size x the local batch) wants size x the single-process
    rate; starting there diverges, so the rate grows linearly, batch by batch.
    """

    def __init__(self, initial_lr: Optional[float] = None, warmup_epochs: int = 5,
                 momentum_correction: bool = True, steps_per_epoch: Optional[int] = None,
                 verbose: int = 0) -> None:
        def multiplier(epoch: float) -> float:
            n = hvd_tf.size()
            epoch += 1.0 / self.steps_per_epoch  # reach exactly 1 at the end of the warmup
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.verbose and hvd_tf.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{_get_lr(self.model.optimizer):g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """ModelCheckpoint that keeps only the best model by `monitor` (Horovod's estimator
    callback); `filepath` may be set on the instance before fit()."""

    def __init__(self, monitor: str = "val_loss", verbose: int = 0, mode: str = "auto",
                 save_freq="epoch", filepath: str = "best_model.keras") -> None:
        super().__init__(filepath=filepath, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=False, mode=mode, save_freq=save_freq)
