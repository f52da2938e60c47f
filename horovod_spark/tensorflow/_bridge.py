"""How a TensorFlow op reaches a numpy kernel (see `_kernels`).

Eager: the kernel runs at once on the tensors' values.  Inside a tf.function:
the kernel runs as a stateful `tf.numpy_function` (a dense float allreduce runs
as the native op of `_lane_op` instead), so TensorFlow keeps our ops in program
order (every rank issues its collectives in one order) and never prunes them,
and the outputs get their static shapes back with `set_shape`.  In a graph
built outside tf.function (tf.compat.v1), which has no such order, every kernel
runs as an asynchronous op instead (`_async_op`), so no order can deadlock.
The kernels take numpy arrays, and numpy has no bfloat16, so bfloat16 travels
as float32 (reduced in float32, rounded once on the way back).

A *name* labels an op in errors and the timeline, and the fusion engine
matches ops across ranks by it.  Without one, a traced op is named after its
input tensor (the same on every rank that runs the same program, as in
Horovod) and an eager op after its kind and a per-kind call count.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

from . import _async_op
from ._errors import converted
from ._graph import check_not_xla, ordered

__all__ = ["call", "ordered", "op_name", "site_suffix", "to_wire", "from_wire", "check_not_xla"]

_counters: dict = {}
_sites: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def op_name(kind: str, tensor, name: Optional[str], ps=None) -> str:
    """The name an op travels under (eager counts per process set `ps`, a view or None)."""
    if name:
        return str(name)
    if not tf.executing_eagerly() and hasattr(tensor, "name"):
        return f"{kind}.{tensor.name}"
    counter = _counters.setdefault(kind if ps is None else (kind, ps.tag), itertools.count())
    return f"{kind}.noname.{next(counter)}"


def site_suffix(prefix: str) -> str:
    """'' for the first use of `prefix` in the graph being traced, then '.1', '.2', ...

    Tracing is deterministic, so every rank numbers the call sites of one
    function alike: two sites (two tapes in one step, say) get names of their
    own in errors, the timeline and the engine's cache.  Eager calls finish
    before they return, so they reuse their names.
    """
    if tf.executing_eagerly():
        return ""
    counts = _sites.setdefault(tf.compat.v1.get_default_graph(), {})
    k = counts.get(prefix, 0)
    counts[prefix] = k + 1
    return f".{k}" if k else ""


def to_wire(t: tf.Tensor) -> tf.Tensor:
    return tf.cast(t, tf.float32) if t.dtype == tf.bfloat16 else t


def from_wire(t: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    return tf.cast(t, dtype) if t.dtype != dtype else t


def call(kernel: Callable, inputs: Sequence[tf.Tensor], touts: Sequence[tf.DType],
         shapes: Sequence, name: str) -> list:
    """Run kernel(*numpy inputs) -> list of arrays, eagerly or as a graph op."""
    if tf.executing_eagerly():
        with converted():
            outs = kernel(*[np.asarray(t) for t in inputs])
        return [tf.convert_to_tensor(o, dtype=d) for o, d in zip(outs, touts)]
    check_not_xla(name)
    if not ordered():
        outs = _async_op.call(tf, kernel, inputs, touts)
        if outs is not None:
            for o, s in zip(outs, shapes):
                o.set_shape(s)
            return outs

    def graph_kernel(*arrays):
        return [np.asarray(o, dtype=d.as_numpy_dtype) for o, d in zip(kernel(*arrays), touts)]

    outs = tf.numpy_function(graph_kernel, list(inputs), list(touts), stateful=True)
    for o, s in zip(outs, shapes):
        o.set_shape(s)
    return list(outs)
