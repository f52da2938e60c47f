"""Allreduce of a model's gradients: shared by DistributedGradientTape and the
Keras DistributedOptimizer.

Each gradient is named after its variable (`<prefix>.<index>.<variable path>`),
which every rank derives the same way.  Dense gradients travel as *groups*: by
default all of them as one fused op; `groups` (Horovod's argument) splits them
into several.  tf.IndexedSlices are allgathered, or densified first with
`sparse_as_dense`.  `gradient_predivide_factor` f splits Average's 1/size into
a prescale of 1/f and a postscale of f/size.  Gradients of *local* variables
(registered by the Partial* wrappers) are not reduced: each rank keeps its own,
divided by the world size unless told otherwise, as Horovod's are.
"""
from __future__ import annotations

from typing import Optional, Sequence

import tensorflow as tf

from . import _basics
from ._bridge import site_suffix
from .compression import Compression
from .mpi_ops import Adasum, Average, Sum, allreduce_dense, allreduce_sparse, resolve_op

__all__ = ["GradientReducer"]


def _label(v, i: int) -> str:
    return str(getattr(v, "path", None) or getattr(v, "name", None) or f"var{i}")


class GradientReducer:
    """What to do with a list of gradients; built once per tape or optimizer."""

    def __init__(self, prefix: str, compression=Compression.none, sparse_as_dense: bool = False,
                 op=Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                 groups=None, process_set=None) -> None:
        self.prefix = prefix
        self.process_set = process_set  # None or a ProcessSet: the ranks that average
        if not _excluded(process_set):
            _basics.view(process_set, prefix)  # an unregistered set: refused at once
        self.compression = compression
        self.sparse_as_dense = bool(sparse_as_dense)
        self.op = resolve_op(op, None)
        if self.op not in (Average, Sum, Adasum):
            raise ValueError(f"{prefix}: gradients are reduced with Average, Sum or Adasum, "
                             f"got {self.op.name.lower()}")
        if gradient_predivide_factor != 1.0 and self.op != Average:
            raise ValueError(f"{prefix}: gradient_predivide_factor needs op=Average")
        self.predivide = float(gradient_predivide_factor)
        if groups is None and num_groups:
            groups = int(num_groups)
        if isinstance(groups, int) and groups < 0:
            raise ValueError(f"{prefix}: groups must be >= 0, got {groups}")
        self.groups = groups
        self._local: dict = {}  # id -> variable (held, so the id stays its own)
        self.scale_local = True

    def register_local(self, variable) -> None:
        """Keep `variable`'s gradient on this rank (not reduced)."""
        self._local[id(variable)] = variable

    def _local_grad(self, g, ps):
        if not self.scale_local:
            return g
        n = _basics.size_of(ps)
        if isinstance(g, tf.IndexedSlices):
            return tf.IndexedSlices(g.values / tf.cast(n, g.values.dtype), g.indices, g.dense_shape)
        return g / tf.cast(n, g.dtype)

    def _scaling(self, ps):
        if self.op == Average and self.predivide != 1.0:
            return Sum, 1.0 / self.predivide, self.predivide / _basics.size_of(ps)
        return self.op, 1.0, 1.0

    def _partition(self, dense: list, variables) -> list:
        """Lists of positions in `dense` that travel as one fused op each."""
        if not self.groups:
            return [dense] if dense else []
        if isinstance(self.groups, int):
            n = min(self.groups, len(dense)) or 1
            return [dense[k::n] for k in range(n)]
        where = {id(v): g for g, vs in enumerate(self.groups) for v in vs}
        parts: dict = {}
        for i in dense:
            key = where.get(id(variables[i]), ("alone", i)) if variables is not None else 0
            parts.setdefault(key, []).append(i)
        return list(parts.values())

    def reduce(self, grads: Sequence, variables: Optional[Sequence] = None) -> list:
        """The reduced gradients, in order; None stays None."""
        grads = list(grads)
        prefix = self.prefix + site_suffix(self.prefix)
        labels = [f"{prefix}.{i}." + (_label(variables[i], i) if variables is not None else "g")
                  for i in range(len(grads))]
        if _excluded(self.process_set):  # outside the set: its own gradients, as Horovod's
            return grads
        ps = _basics.view(self.process_set, self.prefix)
        op, pre, post = self._scaling(ps)
        out: list = [None] * len(grads)
        dense = []
        for i, g in enumerate(grads):
            if g is None:
                continue
            if self._local and variables is not None and id(variables[i]) in self._local:
                out[i] = self._local_grad(g, ps)
                continue
            if isinstance(g, tf.IndexedSlices) and not self.sparse_as_dense:
                out[i] = allreduce_sparse(g, labels[i], op, pre, post, ps)
                continue
            dense.append(i)
        wires = {i: self.compression.compress(tf.convert_to_tensor(grads[i])) for i in dense}
        for part in self._partition(dense, variables):
            reduced = _allreduce_part([wires[i][0] for i in part], [labels[i] for i in part],
                                      op, pre, post, ps)
            for i, r in zip(part, reduced):
                out[i] = self.compression.decompress(r, wires[i][1])
        return out


def _excluded(process_set) -> bool:
    """Whether this rank is outside `process_set` (a registered set)."""
    return process_set is not None and getattr(process_set, "included", lambda: None)() is False


def _allreduce_part(xs: list, names: list, op, pre: float, post: float, ps=None) -> list:
    """One group's reduced tensors.  A group of one dtype whose shapes are static
    travels packed: TensorFlow concatenates it into one flat tensor (one memcpy in
    C++), which crosses into Python and the engine as one op, and splits the result
    back.  Each tensor of a group costs the bridge and the engine a conversion, a
    request and a handle; one flat tensor costs them once per step.  Adasum's
    tensors travel apart: each has its own dot products."""
    shapes = [x.shape for x in xs]
    if len(xs) < 2 or op is Adasum or len({x.dtype for x in xs}) > 1 or \
            not all(s.is_fully_defined() for s in shapes):
        return allreduce_dense(xs, names, op, pre, post, ps)
    sizes = [s.num_elements() for s in shapes]
    flat = tf.concat([tf.reshape(x, [-1]) for x in xs], 0)
    (reduced,) = allreduce_dense([flat], [f"{names[0]}+{len(xs) - 1}.packed"], op, pre, post,
                                 ps)
    return [tf.reshape(r, s) for r, s in zip(tf.split(reduced, sizes), shapes)]
