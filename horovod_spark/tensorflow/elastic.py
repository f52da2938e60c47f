"""Horovod's `hvd.elastic` for TensorFlow: `run`, `TensorFlowKerasState`, `TensorFlowState`,
`ObjectState` (see `horovod_spark.torch.elastic` for the shape of a training function and
docs/elastic.md for what survives an attempt).

Variables are saved as numpy copies; `sync()` broadcasts them from rank 0 in one fused
broadcast.  Eager TensorFlow 2 only (`session` is accepted for Horovod's signature).
"""
from __future__ import annotations

from typing import Any, List, Optional

import numpy as np

from ..common.elastic import HostsUpdatedInterrupt, State
from ..common.elastic import ObjectState as _ObjectState
from ..common.elastic import run
from . import _basics
from .functions import broadcast_object, broadcast_variables

__all__ = ["run", "State", "ObjectState", "TensorFlowState", "TensorFlowKerasState",
           "HostsUpdatedInterrupt"]


class ObjectState(_ObjectState):
    """Named picklable values (`state.epoch`, `state.batch`), synced from rank 0."""

    def __init__(self, bcast_object=None, session=None, **kwargs) -> None:
        super().__init__(bcast_object or broadcast_object, _basics.rank, **kwargs)


class _VariablesState(_ObjectState):
    """Variables saved as numpy copies, plus named values."""

    def __init__(self, **kwargs) -> None:
        self._saved_vars: Optional[List[np.ndarray]] = None
        super().__init__(broadcast_object, _basics.rank, **kwargs)

    def _variables(self) -> list:
        raise NotImplementedError

    def _save_vars(self) -> None:
        self._saved_vars = [np.array(v.numpy(), copy=True) for v in self._variables()]

    def save(self) -> None:
        self._save_vars()
        super().save()

    def restore(self) -> None:
        variables = self._variables()
        if len(variables) != len(self._saved_vars):
            raise ValueError(f"elastic restore: the state has {len(variables)} variables, the "
                             f"saved copy {len(self._saved_vars)}; build the model (and its "
                             f"optimizer) the same way in every attempt")
        for var, value in zip(variables, self._saved_vars):
            var.assign(value)
        super().restore()

    def sync(self) -> None:
        broadcast_variables(self._variables(), root_rank=0)
        super().sync()
        self._save_vars()

    def _snapshot(self) -> Any:
        return {"variables": self._saved_vars, "values": super()._snapshot()}

    def _load(self, snapshot: Any) -> None:
        self._saved_vars = snapshot["variables"]
        super()._load(snapshot["values"])


class TensorFlowState(_VariablesState):
    """A list of tf.Variables and named values.

    Args:
        variables: the variables to keep (e.g. a model's plus its optimizer's).
        session: TF1's; eager TensorFlow 2 needs none.
        **kwargs: named picklable values, as ObjectState's.
    """

    def __init__(self, variables=None, session=None, **kwargs) -> None:
        self.variables = list(variables or [])
        super().__init__(**kwargs)
        self._save_vars()

    def _variables(self) -> list:
        return self.variables


class TensorFlowKerasState(_VariablesState):
    """A Keras model, its optimizer and named values.

    Args:
        model: a built Keras model.
        optimizer: default: the model's.  It is built (its slots made) before the first save,
            so every attempt keeps and restores the same variables.
        backend: Horovod's; unused.
        **kwargs: named picklable values, as ObjectState's.
    """

    def __init__(self, model, optimizer=None, backend=None, **kwargs) -> None:
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        super().__init__(**kwargs)
        self._save_vars()

    def _variables(self) -> list:
        opt = self.optimizer  # a dropout's seed state is each rank's own, as in the broadcast
        model = [v for v in self.model.variables  # callback
                 if not str(getattr(v, "path", "")).endswith("seed_generator_state")]
        if opt is None:
            return model
        if not getattr(opt, "built", True):
            opt.build(self.model.trainable_variables)
        return model + list(opt.variables)
