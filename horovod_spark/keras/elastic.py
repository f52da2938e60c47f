"""Horovod's `hvd.elastic` for Keras: the states of `tensorflow.elastic` and three callbacks.

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)

    @hvd.elastic.run
    def train(state):
        model.fit(data, steps_per_epoch=steps, epochs=epochs - state.epoch, callbacks=[
            hvd.elastic.UpdateBatchStateCallback(state),
            hvd.elastic.UpdateEpochStateCallback(state),
            hvd.elastic.CommitStateCallback(state, batches_per_commit=10)])

The callbacks keep `state.batch` and `state.epoch` current and commit every N batches and
at each epoch's end; list them in this order, so a commit holds the counters of its batch.
"""
from __future__ import annotations

import keras

from ..tensorflow.elastic import (HostsUpdatedInterrupt, ObjectState, State, TensorFlowKerasState,
                                  TensorFlowState, run)

KerasState = TensorFlowKerasState  # Horovod's other name for it

__all__ = ["run", "State", "ObjectState", "TensorFlowState", "TensorFlowKerasState", "KerasState",
           "HostsUpdatedInterrupt", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback"]


class CommitStateCallback(keras.callbacks.Callback):
    """`state.commit()` every `batches_per_commit` batches and at the end of each epoch."""

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        if isinstance(batches_per_commit, bool) or not isinstance(batches_per_commit, int) or \
                batches_per_commit < 1:
            raise ValueError(f"batches_per_commit must be an int >= 1, got {batches_per_commit!r}")
        self.state, self.batches_per_commit = state, batches_per_commit
        self._left = batches_per_commit

    def on_train_begin(self, logs=None):
        self._left = self.batches_per_commit  # every rank counts from the same start

    def on_train_batch_end(self, batch, logs=None):
        self._left -= 1
        if self._left == 0:
            self.state.commit()
            self._left = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps `state.batch` at the batches done in the current epoch (0 after an epoch).

    Keras 3's `fit` cannot shorten an epoch it has begun, so an attempt that resumes from a
    commit inside an epoch runs that epoch whole; commit at epoch ends (the default of
    `CommitStateCallback` too) to resume exactly.
    """

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self._first = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._first = self.state.batch

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = self._first + batch + 1

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keeps `state.epoch` at the epochs done over every attempt (so `epochs - state.epoch`
    are left)."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self._first = state.epoch

    def on_train_begin(self, logs=None):
        self._first = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self._first + epoch + 1
