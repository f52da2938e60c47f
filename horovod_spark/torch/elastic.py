"""Horovod's `hvd.elastic` for torch: `run`, `TorchState`, `ObjectState`.

    state = hvd.elastic.TorchState(model=model, optimizer=opt, batch=0)

    @hvd.elastic.run
    def train(state):
        for state.batch in range(state.batch, steps):
            ...
            if state.batch % 10 == 0:
                state.commit()

A commit keeps CPU copies of the model's and the optimizer's state_dicts and the named
values; in a job of `horovod_spark.run_elastic` rank 0's copy goes to the driver, and the
next attempt starts from it (see docs/elastic.md).
"""
from __future__ import annotations

import copy
from typing import Any

import torch

from .._elastic import HostsUpdatedInterrupt, State
from .._elastic import ObjectState as _ObjectState
from .._elastic import run
from . import _state
from .functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters

__all__ = ["run", "State", "ObjectState", "TorchState", "HostsUpdatedInterrupt"]


def _cpu(value: Any) -> Any:
    """A copy of a state_dict (nested dicts and lists of tensors) with CPU tensors."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu(v) for v in value)
    return copy.deepcopy(value)


class ObjectState(_ObjectState):
    """Named picklable values (`state.epoch`, `state.batch`), synced from rank 0."""

    def __init__(self, **kwargs) -> None:
        super().__init__(broadcast_object, _state.rank, **kwargs)


class TorchState(_ObjectState):
    """A model, an optimizer and named values, saved by `commit()`.

    Args:
        model: a torch.nn.Module (its state_dict: parameters and buffers).
        optimizer: a torch.optim.Optimizer (hvd.DistributedOptimizer too).
        **kwargs: named picklable values, as ObjectState's.
    """

    def __init__(self, model: torch.nn.Module = None, optimizer: torch.optim.Optimizer = None,
                 **kwargs) -> None:
        self.model, self.optimizer = model, optimizer
        self._saved_model = self._saved_optimizer = None
        super().__init__(broadcast_object, _state.rank, **kwargs)
        self._save_modules()

    def _save_modules(self) -> None:
        if self.model is not None:
            self._saved_model = _cpu(self.model.state_dict())
        if self.optimizer is not None:
            self._saved_optimizer = _cpu(self.optimizer.state_dict())

    def save(self) -> None:
        self._save_modules()
        super().save()

    def restore(self) -> None:
        if self.model is not None:
            self.model.load_state_dict(self._saved_model)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(self._saved_optimizer)
        super().restore()

    def sync(self) -> None:
        """Rank 0's model, optimizer and values on every rank; then saved."""
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0, prefix="elastic.model")
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0, prefix="elastic.")
        super().sync()
        self._save_modules()

    def _snapshot(self) -> Any:
        return {"model": self._saved_model, "optimizer": self._saved_optimizer,
                "values": super()._snapshot()}

    def _load(self, snapshot: Any) -> None:
        self._saved_model, self._saved_optimizer = snapshot["model"], snapshot["optimizer"]
        super()._load(snapshot["values"])
