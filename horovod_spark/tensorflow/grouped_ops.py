"""Grouped allgather and reducescatter: several tensors as one submission.

Every tensor of a group travels under its own name (`<name>.<i>`), all
submitted before any is waited for, so the engine fuses them; gradients are
those of the single ops (see mpi_ops), tensor by tensor.
"""
from __future__ import annotations

from typing import Optional

import tensorflow as tf

from . import _basics, _kernels
from ._bridge import call, from_wire, op_name, to_wire
from ._errors import InvalidArgument
from .compression import Compression
from .mpi_ops import (Average, Sum, _allgather_grad, _as_rows, _my_rows, _view, allgather,
                      global_process_set, resolve_op)

__all__ = ["grouped_allgather", "grouped_reducescatter"]


def _names(kind: str, tensors: list, name: Optional[str], ps=None) -> list:
    base = name or op_name(kind, tensors[0] if tensors else None, None, ps)
    return [f"{base}.{i}" for i in range(len(tensors))]


def grouped_allgather(tensors, name: Optional[str] = None,
                      process_set=global_process_set) -> list:
    """allgather of each tensor (first dims may differ), as one group."""
    ps = _view(process_set, "grouped_allgather")
    tensors = [_as_rows(t) for t in tensors]
    if not tensors:
        return []
    names = _names("grouped_allgather", tensors, name, ps)

    @tf.custom_gradient
    def fwd(*xs):
        wires = [to_wire(x) for x in xs]
        shapes = [tf.TensorShape([None]).concatenate(x.shape[1:]) for x in xs]
        ys = call(lambda *a: _kernels.allgather_group(a, names, ps), wires,
                  [w.dtype for w in wires], shapes, names[0])

        def grad(*dys):
            return [_allgather_grad(dy, x, n, ps) for dy, x, n in zip(dys, xs, names)]

        return [from_wire(y, x.dtype) for y, x in zip(ys, xs)], grad

    return list(fwd(*tensors))


def grouped_reducescatter(tensors, device_dense: str = "", compression=Compression.none,
                          op=Average, name: Optional[str] = None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0, process_set=global_process_set) -> list:
    """reducescatter of each tensor, as one group: this rank's block of rows of each."""
    op = resolve_op(op, None, "grouped_reducescatter")
    ps = _view(process_set, "grouped_reducescatter")
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    for i, t in enumerate(tensors):
        if t.shape.rank == 0:
            raise InvalidArgument(None, None, f"grouped_reducescatter: tensor {i} is 0-d, with no "
                                  f"rows to scatter (rank {_basics.rank()}/{_basics.size()})")
    if not tensors:
        return []
    names = _names("grouped_reducescatter", tensors, name, ps)
    pre, post = float(prescale_factor), float(postscale_factor)

    @tf.custom_gradient
    def fwd(*xs):
        packed = [compression.compress(to_wire(x)) for x in xs]
        wires = [w for w, _ in packed]
        shapes = [tf.TensorShape([_my_rows(x.shape[0], ps)]).concatenate(x.shape[1:]) for x in xs]
        ys = call(lambda *a: _kernels.reducescatter_group(a, names, op, pre, post, ps), wires,
                  [w.dtype for w in wires], shapes, names[0])
        ys = [from_wire(compression.decompress(y, c), x.dtype)
              for y, (_, c), x in zip(ys, packed, xs)]

        def grad(*dys):
            if op not in (Sum, Average):
                raise NotImplementedError(f"grouped_reducescatter '{names[0]}': no gradient for "
                                          f"{op.name.lower()}")
            scale = pre * post * (_basics.size_of(ps) if op == Sum else 1)
            out = []
            for dy, x, n in zip(dys, xs, names):
                g = allgather(dy, name=f"{n}.grad", process_set=ps)
                g = g if scale == 1.0 else g * tf.cast(scale, g.dtype)
                g.set_shape(x.shape)
                out.append(g)
            return out

        return ys, grad

    return list(fwd(*tensors))
