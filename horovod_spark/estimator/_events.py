"""Rank 0's TensorBoard event file of a fit, under ``<store>/runs/<run_id>/logs``.

Written with tensorboardX (no TensorFlow needed), by rank 0 alone.  Tags:
``epoch/<metric>`` per epoch (the history's values, the learning rate,
``samples_per_second`` and, where the framework adapter counts it,
``allreduce_share``: the part of the epoch's wall time spent inside allreduce
collectives), at step = the epoch's number (1-based); ``step/loss`` and
``step/lr`` every ``log_every_n_steps`` steps, at step = the global step.  A
store that is not a local directory gets the files copied to it after every
epoch, from a local temporary directory.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from typing import Any, Dict, Optional

from horovod_spark.estimator.store import LocalStore, Store

__all__ = ["EventLog", "logs_path"]


def logs_path(store: Store, run_id: str) -> str:
    return store.join("runs", run_id, "logs")


def _writer_class(required: Optional[bool]):
    if required is False:
        return None
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        if required:
            raise ImportError("tensorboard=True needs the tensorboardX package: pip install "
                              "'horovod-spark[tensorboard]' (or tensorboard=None to skip the "
                              "logs where it is missing)") from None
        return None
    return SummaryWriter


class EventLog:
    """Rank 0's writer; on other ranks, or without tensorboardX, every call does nothing."""

    def __init__(self, store: Store, run_id: str, rank: int, required: Optional[bool],
                 every: int = 0):
        cls = _writer_class(required) if rank == 0 else None
        self.every, self.writer, self.local, self.remote = every, None, None, None
        if cls is None:
            return
        self.remote = logs_path(store, run_id)
        if isinstance(store, LocalStore):
            self.local = self.remote
        else:
            self.local, self.copy_to = tempfile.mkdtemp(prefix="hvs-logs-"), store
        os.makedirs(self.local, exist_ok=True)
        self.writer = cls(self.local, flush_secs=30)

    @property
    def active(self) -> bool:
        return self.writer is not None

    def wants_step(self, global_step: int) -> bool:
        return self.writer is not None and self.every > 0 and global_step % self.every == 0

    def step(self, global_step: int, values: Dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(f"step/{name}", float(value), global_step)

    def epoch(self, epoch: int, values: Dict[str, Any]) -> None:
        if self.writer is None:
            return
        for name, value in values.items():
            if value is not None:
                self.writer.add_scalar(f"epoch/{name}", float(value), epoch + 1)
        self.writer.flush()
        self._sync()

    def _sync(self) -> None:
        if self.local == self.remote:
            return
        try:
            for name in os.listdir(self.local):
                with open(os.path.join(self.local, name), "rb") as f:
                    self.copy_to.write_bytes(f"{self.remote}/{name}", f.read())
        except OSError as exc:  # the logs never fail a fit
            warnings.warn(f"could not copy the TensorBoard logs to {self.remote}: {exc}")

    def close(self) -> None:
        if self.writer is None:
            return
        self.writer.close()
        self._sync()
        if self.local != self.remote:
            shutil.rmtree(self.local, ignore_errors=True)
        self.writer = None
