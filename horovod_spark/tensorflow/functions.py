"""Helpers over the ops: broadcast variables and Python objects, gather objects."""
from __future__ import annotations

from typing import Optional

import tensorflow as tf

from . import _kernels
from .mpi_ops import _view, broadcast_raw, global_process_set

__all__ = ["broadcast_variables", "broadcast_global_variables", "broadcast_object",
           "broadcast_object_fn", "allgather_object", "broadcast_"]


def _var_label(i: int, v) -> str:
    return f"broadcast_variables.{i}.{getattr(v, 'path', None) or getattr(v, 'name', 'var')}"


def broadcast_variables(variables, root_rank: int = 0, process_set=global_process_set):
    """Assign root_rank's values to `variables` on every rank (of `process_set`), as one
    fused broadcast.

    Returns:
        None in eager mode; inside a tf.function, the op that groups the assignments.
    """
    ps = _view(process_set, "broadcast_variables")
    variables = list(variables)
    if not variables:
        return None if tf.executing_eagerly() else tf.no_op()
    values = [tf.convert_to_tensor(v) for v in variables]
    new = broadcast_raw(values, [_var_label(i, v) for i, v in enumerate(variables)], int(root_rank),
                        ps)
    assigns = [v.assign(n) for v, n in zip(variables, new)]
    return None if tf.executing_eagerly() else tf.group(*assigns)


def broadcast_(variables, root_rank: int = 0, name: Optional[str] = None,
               process_set=global_process_set) -> list:
    """Overwrite `variables` with root_rank's values, in place (one fused broadcast).

    Returns:
        The variables' new values.
    """
    ps = _view(process_set, "broadcast_")
    variables = list(variables)
    if not variables:
        return []
    labels = [f"{name}.{i}" if name else _var_label(i, v) for i, v in enumerate(variables)]
    new = broadcast_raw([tf.convert_to_tensor(v) for v in variables], labels, int(root_rank), ps)
    for v, n in zip(variables, new):
        v.assign(n)
    return [v.read_value() if hasattr(v, "read_value") else tf.convert_to_tensor(v)
            for v in variables]


def broadcast_global_variables(root_rank: int = 0):
    """TensorFlow 1's graph collections do not exist in eager TensorFlow 2."""
    raise RuntimeError("broadcast_global_variables() needs TF1 graph collections; use "
                       "hvd.broadcast_variables(model.variables + optimizer.variables, root_rank) "
                       "or the Keras BroadcastGlobalVariablesCallback")


def broadcast_object(obj, root_rank: int = 0, session=None, name: Optional[str] = None,
                     process_set=global_process_set):
    """root_rank's Python object on every rank (cloudpickle; eager mode)."""
    ps = _view(process_set, "broadcast_object")
    return _kernels.broadcast_object(obj, int(root_rank), name or "broadcast_object", ps)


def broadcast_object_fn(root_rank: int = 0, session=None, name: Optional[str] = None,
                        process_set=global_process_set):
    """A function that broadcasts its argument from root_rank (Horovod's TF1 helper; eager here)."""
    def fn(obj):
        return broadcast_object(obj, root_rank, name=name, process_set=process_set)
    return fn


def allgather_object(obj, session=None, name: Optional[str] = None,
                     process_set=global_process_set) -> list:
    """Every rank's (of `process_set`) Python object, in set rank order (eager mode)."""
    ps = _view(process_set, "allgather_object")
    return _kernels.allgather_object(obj, name or "allgather_object", ps)
