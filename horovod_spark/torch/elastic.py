"""Horovod's `hvd.elastic` for torch: `run`, `TorchState`, `ObjectState`, `ElasticSampler`.

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

`ElasticSampler` is Horovod's: a DistributedSampler that counts the samples the world has
processed this epoch (`record_batch`), so that a TorchState holding it (`TorchState(...,
sampler=sampler)`) restarts the epoch with only the rest, split over the ranks the next
attempt has, however many.
"""
from __future__ import annotations

import copy
import math
import random
from typing import Any, Dict

import torch

from ..common.elastic import HostsUpdatedInterrupt, State
from ..common.elastic import ObjectState as _ObjectState
from ..common.elastic import run
from . import _state
from .functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler",
           "HostsUpdatedInterrupt"]


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


class ElasticSampler(torch.utils.data.Sampler):
    """Horovod's ElasticSampler: the dataset's indices split over the ranks (padded to an
    even split, as DistributedSampler), minus the samples the world processed this epoch.

    Use: put it in the TorchState (`TorchState(model, optimizer, sampler=sampler)`), call
    `record_batch(batch_idx, batch_size)` after each batch (or `record_indices`), and
    `set_epoch(epoch)` at the end of each epoch (not the start: a restarted epoch must not
    process its samples again).  On a restart the state gives every rank the epoch and the
    count processed, and `reset()` splits the rest over the new world.

    Args:
        dataset: the dataset (its length is assumed constant).
        shuffle: shuffle the indices, the same way on every rank, per epoch.
        seed: the shuffle's seed, the same on every rank.
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_num = 0
        self.num_replicas, self.rank = 1, 0
        self.remaining_indices: list = []
        self.num_samples = self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` (call it at the end of the previous one): nothing processed yet."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Every rank processed a batch of `batch_size` samples."""
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices) -> None:
        """`indices` (gathered from every rank) were processed."""
        self.processed_num += len(indices)

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: Dict[str, int]) -> None:
        self.epoch = int(state_dict["epoch"])
        self.processed_num = int(state_dict["processed_num"])
        self.reset()

    def reset(self) -> None:
        """Split what this epoch has left over the world as it is now."""
        self.num_replicas = _state.size() if _state.is_initialized() else 1
        self.rank = _state.rank() if _state.is_initialized() else 0
        indices = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(indices)
        self.remaining_indices = indices[self.processed_num:]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        indices = self.remaining_indices[:]
        indices += indices[:self.total_size - len(indices)]  # an even split: pad from the start
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples


class TorchState(_ObjectState):
    """A model, an optimizer and named values, saved by `commit()`.

    Args:
        model: a torch.nn.Module (its state_dict: parameters and buffers).
        optimizer: a torch.optim.Optimizer (hvd.DistributedOptimizer too).
        **kwargs: named picklable values, as ObjectState's; an ElasticSampler among them is
            kept by its state_dict (not copied with its dataset) and split anew over the
            world at every sync.
    """

    def __init__(self, model: torch.nn.Module = None, optimizer: torch.optim.Optimizer = None,
                 **kwargs) -> None:
        self.model, self.optimizer = model, optimizer
        self._saved_model = self._saved_optimizer = None
        self._samplers = {k: v for k, v in kwargs.items() if isinstance(v, ElasticSampler)}
        self._saved_samplers: Dict[str, Dict[str, int]] = {}
        for name, sampler in self._samplers.items():
            setattr(self, name, sampler)
        super().__init__(broadcast_object, _state.rank,
                         **{k: v for k, v in kwargs.items() if k not in self._samplers})
        self._save_modules()

    def _save_modules(self) -> None:
        if self.model is not None:
            self._saved_model = _cpu(self.model.state_dict())
        if self.optimizer is not None:
            self._saved_optimizer = _cpu(self.optimizer.state_dict())
        self._saved_samplers = {k: dict(s.state_dict()) for k, s in self._samplers.items()}

    def save(self) -> None:
        self._save_modules()
        super().save()

    def restore(self) -> None:
        if self.model is not None:
            self.model.load_state_dict(self._saved_model)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(self._saved_optimizer)
        for name, sampler in self._samplers.items():
            if name in self._saved_samplers:
                sampler.load_state_dict(self._saved_samplers[name])
        super().restore()

    def sync(self) -> None:
        """Rank 0's model, optimizer and values on every rank; then saved."""
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0, prefix="elastic.model")
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0, prefix="elastic.")
        if self._samplers:  # rank 0's progress, split over this world's ranks
            states = broadcast_object({k: s.state_dict() for k, s in self._samplers.items()},
                                      root_rank=0, name="elastic.samplers")
            for name, sampler in self._samplers.items():
                sampler.load_state_dict(states[name])
        super().sync()
        self._save_modules()

    def _snapshot(self) -> Any:
        return {"model": self._saved_model, "optimizer": self._saved_optimizer,
                "samplers": self._saved_samplers, "values": super()._snapshot()}

    def _load(self, snapshot: Any) -> None:
        self._saved_model, self._saved_optimizer = snapshot["model"], snapshot["optimizer"]
        self._saved_samplers = dict(snapshot.get("samplers") or {})
        super()._load(snapshot["values"])
