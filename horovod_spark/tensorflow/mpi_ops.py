"""Collective ops on TensorFlow tensors, with Horovod's names, defaults and gradients.

Each op runs one numpy kernel (`_kernels`) through `_bridge.call`, in eager
mode or inside a tf.function, and carries the gradient Horovod defines:

  allreduce      the upstream gradient allreduced with the same op and factors
                 (Sum and Average; Min, Max and Product have none)
  allgather      the gradient averaged over ranks, then this rank's rows
  broadcast      the gradient averaged over ranks on the root, zeros elsewhere
  alltoall       the gradient sent back along the received splits
  reducescatter  the gradient allgathered, times the factors (and the world size
                 for Sum, so Average's gradient is the gathered gradient itself)
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import tensorflow as tf

from collectives import ReduceOp
from collectives.adasum import ADASUM, check_world, is_adasum

from ..common.process_sets import ProcessSet
from . import _basics, _kernels, _lane_op
from ._bridge import call, from_wire, op_name, to_wire
from ._errors import InvalidArgument
from .compression import Compression

__all__ = ["Average", "Sum", "Min", "Max", "Product", "Adasum", "ProcessSet", "global_process_set",
           "add_process_set", "remove_process_set", "allreduce", "grouped_allreduce",
           "allgather", "broadcast", "alltoall", "reducescatter", "barrier", "join",
           "size_op", "rank_op", "local_size_op", "local_rank_op", "process_set_included_op"]

Average, Sum, Min, Max, Product = (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX,
                                   ReduceOp.PRODUCT)
Adasum = ADASUM  # combined by the adaptive-sum tree (see collectives.adasum)
global_process_set = _basics.global_process_set


def add_process_set(process_set) -> ProcessSet:
    """Register a process set (a ProcessSet or a list of world ranks) on every rank, in the
    same order; needs dynamic process sets (HOROVOD_DYNAMIC_PROCESS_SETS=1 or
    hvd.init(process_sets="dynamic")).  Returns the registered ProcessSet."""
    return _basics.add_process_set(process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set on every rank; False for the global set or an unknown one."""
    return _basics.remove_process_set(process_set)


def _view(process_set, what: str):
    """The set an op runs on (None: every rank); a refusal is an InvalidArgument."""
    try:
        return _basics.view(process_set, what)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def resolve_op(op, average, what: str = "allreduce"):
    """Horovod's op/average rules: default Average; `average` is the deprecated spelling.
    Returns a ReduceOp, or Adasum (allreduce only)."""
    if op is not None and average is not None:
        raise ValueError(f"{what}: pass op or average, not both")
    if op is None:
        return Average if average is None or average else Sum
    if is_adasum(op):
        if "allreduce" not in what:
            raise InvalidArgument(None, None, f"{what}: Adasum applies to allreduce only; "
                                  "use Average or Sum")
        return Adasum
    return ReduceOp(op)


# -- allreduce -------------------------------------------------------------
def _adasum_raw(xs: Sequence[tf.Tensor], names, pre: float, post: float, ps=None) -> list:
    check_world(_basics.size_of(ps), _basics.rank_of(ps), f"allreduce '{names[0]}'")
    for x, n in zip(xs, names):
        if not x.dtype.is_floating:
            raise InvalidArgument(None, None, f"allreduce '{n}': Adasum combines floating "
                                  f"tensors (float16, bfloat16, float32, float64), got {x.dtype.name}")
    wire = [to_wire(x) for x in xs]
    outs = call(lambda *a: _kernels.adasum_group(a, names, pre, post, ps), wire,
                [w.dtype for w in wire], [x.shape for x in xs], names[0])
    return [from_wire(o, x.dtype) for o, x in zip(outs, xs)]


def _half_scaled(xs: Sequence[tf.Tensor], names, op, pre: float, post: float, ps) -> list:
    """float16/bfloat16 with scale factors, as Horovod's CPU ops scale them: each factor
    applied in float32 math and rounded back once (the engine would scale in the tensor's
    own precision), Average as a postscale of 1/size."""
    f32 = tf.float32
    scaled = [tf.cast(tf.cast(x, f32) * float(np.float32(pre)), x.dtype) if pre != 1.0 else x
              for x in xs]
    outs = _allreduce_raw(scaled, names, Sum, 1.0, 1.0, ps)
    post = post / (_basics.size_of(ps) if op == Average else 1)
    if post == 1.0:
        return outs
    return [tf.cast(tf.cast(o, f32) * float(np.float32(post)), o.dtype) for o in outs]


def _allreduce_raw(xs: Sequence[tf.Tensor], names, op, pre: float, post: float,
                   ps=None) -> list:
    if op is Adasum:
        return _adasum_raw(xs, names, pre, post, ps)
    if (pre != 1.0 or post != 1.0) and op in (Sum, Average):
        half = [i for i, x in enumerate(xs) if x.dtype in (tf.float16, tf.bfloat16)]
        if half:  # every rank holds the same dtypes: the split is the same everywhere
            rest = [i for i in range(len(xs)) if i not in half]
            out: list = [None] * len(xs)
            for i, o in zip(half, _half_scaled([xs[i] for i in half], [names[i] for i in half],
                                               op, pre, post, ps)):
                out[i] = o
            if rest:
                for i, o in zip(rest, _allreduce_raw([xs[i] for i in rest],
                                                     [names[i] for i in rest], op, pre, post,
                                                     ps)):
                    out[i] = o
            return out
    if len(xs) == 1 and pre == 1.0 and ps is None:  # in a tf.function: the native op, if it applies
        out = _lane_op.allreduce(tf, xs[0], names[0], op, post)
        if out is not None:
            return [out]
    wire = [to_wire(x) for x in xs]
    outs = call(lambda *a: _kernels.allreduce_group(a, names, op, pre, post, ps), wire,
                [w.dtype for w in wire], [x.shape for x in xs], names[0])
    return [from_wire(o, x.dtype) for o, x in zip(outs, xs)]


def allreduce_dense(xs: Sequence[tf.Tensor], names: Sequence[str], op: ReduceOp,
                    pre: float = 1.0, post: float = 1.0, ps=None) -> list:
    """One fused, differentiable allreduce of dense tensors (over the set `ps`, a view)."""
    names = list(names)

    @tf.custom_gradient
    def fwd(*inputs):
        ys = _allreduce_raw(inputs, names, op, pre, post, ps)

        def grad(*dys):
            if op not in (Sum, Average):  # Adasum too: its tree is not linear
                raise NotImplementedError(f"allreduce '{names[0]}': no gradient for "
                                          f"{op.name.lower()}, only for sum and average")
            dys = [tf.zeros_like(y) if d is None else d for d, y in zip(dys, ys)]
            return allreduce_dense(dys, [f"{n}.grad" for n in names], op, pre, post, ps)

        return ys, grad

    if not xs:
        return []
    return list(fwd(*xs))


def allreduce_sparse(slices: tf.IndexedSlices, name: str, op: ReduceOp,
                     pre: float = 1.0, post: float = 1.0, ps=None) -> tf.IndexedSlices:
    """IndexedSlices reduced by allgathering values and indices (Horovod's way)."""
    if op not in (Sum, Average):  # NotImplementedError, as Horovod's
        raise NotImplementedError(
            f"allreduce '{name}': tf.IndexedSlices support sum and average only, got "
            f"{getattr(op, 'name', str(op)).lower()}; pass sparse_as_dense=True or a dense tensor")
    values = allgather(slices.values, name=f"{name}.values", process_set=ps)
    indices = allgather(slices.indices, name=f"{name}.indices", process_set=ps)
    if op == Average:  # a true division, as Horovod's: integer values come back as floats
        values = values / tf.cast(_basics.size_of(ps), values.dtype)
    if pre * post != 1.0:
        values = values * tf.cast(pre * post, values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def _no_sparse_scaling(pre: float, post: float) -> None:
    """Horovod's allreduce refuses scale factors with tf.IndexedSlices (its optimizers'
    gradient_predivide_factor still reaches sparse gradients, through allreduce_sparse)."""
    if pre != 1.0 or post != 1.0:
        raise NotImplementedError("allreduce: prescale_factor and postscale_factor do not apply "
                                  "to tf.IndexedSlices; scale the values, or densify the "
                                  "slices with tf.convert_to_tensor")


def allreduce(tensor, average=None, device_dense: str = "", device_sparse: str = "",
              compression=Compression.none, op=None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: Optional[str] = None,
              process_set=global_process_set):
    """Reduce `tensor` over every rank of `process_set` (default: Average); tf.IndexedSlices
    via allgather.

    Args:
        compression: Compression.none or Compression.fp16 (what travels on the wire).
        op: Average, Sum, Min, Max, Product or Adasum (a power-of-two world; floating
            tensors; see collectives.adasum).
        prescale_factor, postscale_factor: multiply before and after the reduction.
        name: matches the op across ranks and labels it in errors.
        process_set: the ranks that take part (every rank by default).
    """
    op = resolve_op(op, average)
    ps = _view(process_set, "allreduce")
    if isinstance(tensor, tf.IndexedSlices):
        _no_sparse_scaling(prescale_factor, postscale_factor)
        return allreduce_sparse(tensor, op_name("allreduce", tensor.values, name, ps), op,
                                prescale_factor, postscale_factor, ps)
    tensor = tf.convert_to_tensor(tensor)
    wire, ctx = compression.compress(tensor)
    out = allreduce_dense([wire], [op_name("allreduce", tensor, name, ps)], op,
                          prescale_factor, postscale_factor, ps)[0]
    return compression.decompress(out, ctx)


def grouped_allreduce(tensors, average=None, device_dense: str = "", device_sparse: str = "",
                      compression=Compression.none, op=None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, name: Optional[str] = None,
                      process_set=global_process_set) -> list:
    """allreduce of a list of tensors as one fused op; returns them in order."""
    op = resolve_op(op, average, "grouped_allreduce")
    ps = _view(process_set, "grouped_allreduce")
    tensors = list(tensors)
    base = name or op_name("grouped_allreduce", None, None, ps)
    out: list = [None] * len(tensors)
    dense, wires, ctxs = [], [], []
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            _no_sparse_scaling(prescale_factor, postscale_factor)
            out[i] = allreduce_sparse(t, f"{base}.{i}", op, prescale_factor, postscale_factor, ps)
            continue
        w, c = compression.compress(tf.convert_to_tensor(t))
        dense.append(i)
        wires.append(w)
        ctxs.append(c)
    reduced = allreduce_dense(wires, [f"{base}.{i}" for i in dense], op, prescale_factor,
                              postscale_factor, ps)
    for i, r, c in zip(dense, reduced, ctxs):
        out[i] = compression.decompress(r, c)
    return out


# -- allgather, broadcast --------------------------------------------------
def _as_rows(tensor) -> tf.Tensor:
    tensor = tf.convert_to_tensor(tensor)
    return tf.reshape(tensor, [1]) if tensor.shape.rank == 0 else tensor


def allgather(tensor, name: Optional[str] = None, process_set=global_process_set):
    """Every rank's (of `process_set`) tensor concatenated along dim 0, in set rank order;
    first dims may differ."""
    ps = _view(process_set, "allgather")
    tensor = _as_rows(tensor)
    name = op_name("allgather", tensor, name, ps)

    @tf.custom_gradient
    def fwd(x):
        w = to_wire(x)
        y = call(lambda a: [_kernels.allgather(a, name, ps)], [w], [w.dtype],
                 [tf.TensorShape([None]).concatenate(x.shape[1:])], name)[0]

        def grad(dy):
            return _allgather_grad(dy, x, name, ps)

        return from_wire(y, x.dtype), grad

    return fwd(tensor)


def _allgather_grad(dy, x, name: str, ps=None):
    def kernel(g, rows):
        total = _kernels.allreduce_group([g], [f"{name}.grad"], Average, ps=ps)[0]
        counts = _kernels.allgather(np.array([rows], np.int64), f"{name}.grad.rows", ps)
        start = int(counts[:_basics.rank_of(ps)].sum())
        return [total[start:start + int(rows)]]

    w = to_wire(dy)
    rows = tf.shape(x, out_type=tf.int64)[0]
    return from_wire(call(kernel, [w, rows], [w.dtype], [x.shape], f"{name}.grad")[0], x.dtype)


def broadcast(tensor, root_rank: int = 0, name: Optional[str] = None,
              process_set=global_process_set):
    """root_rank's (a world rank) tensor, on every rank of `process_set`."""
    ps = _view(process_set, "broadcast")
    tensor = tf.convert_to_tensor(tensor)
    root = int(root_rank)
    name = op_name("broadcast", tensor, name, ps)

    @tf.custom_gradient
    def fwd(x):
        y = broadcast_raw([x], [name], root, ps)[0]

        def grad(dy):
            def kernel(g):
                total = _kernels.allreduce_group([g], [f"{name}.grad"], Average, ps=ps)[0]
                return [total if _basics.rank() == root else np.zeros_like(total)]

            w = to_wire(dy)
            return from_wire(call(kernel, [w], [w.dtype], [x.shape], f"{name}.grad")[0], x.dtype)

        return y, grad

    return fwd(tensor)


def broadcast_raw(xs: Sequence[tf.Tensor], names: Sequence[str], root: int, ps=None) -> list:
    """One fused broadcast of several tensors (no gradient) from a world rank."""
    try:
        sroot = _basics.root_of(ps, root, "broadcast")
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    wire = [to_wire(x) for x in xs]
    outs = call(lambda *a: _kernels.broadcast_group(a, list(names), sroot, ps), wire,
                [w.dtype for w in wire], [x.shape for x in xs], names[0])
    return [from_wire(o, x.dtype) for o, x in zip(outs, xs)]


# -- alltoall, reducescatter -----------------------------------------------
def alltoall(tensor, splits=None, name: Optional[str] = None, process_set=global_process_set):
    """Rows splits[j] of `tensor` go to rank j of `process_set` (equal blocks without splits).

    Returns:
        The received rows; with `splits`, (received rows, received splits as int32).
    """
    ps = _view(process_set, "alltoall")
    tensor = _as_rows(tensor)
    name = op_name("alltoall", tensor, name, ps)
    split_t = None if splits is None else tf.cast(tf.reshape(splits, [-1]), tf.int64)

    @tf.custom_gradient
    def fwd(x):
        y, recv = _alltoall_raw(x, split_t, name, ps)

        def grad(dy, _drecv=None):
            back, _ = _alltoall_raw(dy, tf.cast(recv, tf.int64), f"{name}.grad", ps)
            back.set_shape(x.shape)
            return back

        return (y, recv), grad

    out, recv = fwd(tensor)
    return out if splits is None else (out, recv)


def _alltoall_raw(x, splits, name, ps=None):
    w = to_wire(x)
    ins = [w] if splits is None else [w, splits]

    def kernel(a, s=None):
        return list(_kernels.alltoall(a, None if s is None else [int(v) for v in s], name, ps))

    out, recv = call(kernel, ins, [w.dtype, tf.int32],
                     [tf.TensorShape([None]).concatenate(x.shape[1:]), [_basics.size_of(ps)]],
                     name)
    return from_wire(out, x.dtype), recv


def _my_rows(rows: Optional[int], ps=None) -> Optional[int]:
    if rows is None:
        return None
    base, rem = divmod(rows, _basics.size_of(ps))
    return base + (1 if _basics.rank_of(ps) < rem else 0)


def reducescatter(tensor, device_dense: str = "", compression=Compression.none, op=Average,
                  name: Optional[str] = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0, process_set=global_process_set):
    """Reduce over the ranks of `process_set`, keep this rank's block of rows (the first
    ranks get one more)."""
    op = resolve_op(op, None, "reducescatter")
    ps = _view(process_set, "reducescatter")
    if op not in (Sum, Average, Min, Max, Product):
        raise ValueError(f"reducescatter: unknown op {op!r}")
    tensor = tf.convert_to_tensor(tensor)
    if tensor.shape.rank == 0:
        raise InvalidArgument(None, None, f"reducescatter: a 0-d tensor has no rows to scatter "
                              f"(rank {_basics.rank()}/{_basics.size()}); pass at least 1-d")
    name = op_name("reducescatter", tensor, name, ps)
    pre, post = float(prescale_factor), float(postscale_factor)

    @tf.custom_gradient
    def fwd(x):
        w, ctx = compression.compress(to_wire(x))
        shape = tf.TensorShape([_my_rows(x.shape[0], ps)]).concatenate(x.shape[1:])
        y = call(lambda a: [_kernels.reducescatter(a, op, name, pre, post, ps)], [w], [w.dtype],
                 [shape], name)[0]
        y = from_wire(compression.decompress(y, ctx), x.dtype)

        def grad(dy):
            if op not in (Sum, Average):
                raise NotImplementedError(f"reducescatter '{name}': no gradient for {op.name.lower()}")
            g = allgather(dy, name=f"{name}.grad", process_set=ps)
            scale = pre * post * (_basics.size_of(ps) if op == Sum else 1)
            g = g if scale == 1.0 else g * tf.cast(scale, g.dtype)
            g.set_shape(x.shape)
            return g

        return y, grad

    return fwd(tensor)


# -- synchronization and constants ------------------------------------------
def barrier(process_set=global_process_set):
    """Return once every rank (of `process_set`) has reached barrier() (inside a
    tf.function: an op)."""
    ps = _view(process_set, "barrier")
    if tf.executing_eagerly():
        _kernels.barrier(ps)
        return None

    def kernel():
        _kernels.barrier(ps)
        return [np.int32(0)]

    return call(kernel, [], [tf.int32], [[]], "barrier")[0]


def join() -> int:
    """Stop contributing data: wait for every rank to join; returns the last rank to join."""
    if not tf.executing_eagerly():
        return call(lambda: [np.int32(_kernels.join())], [], [tf.int32], [[]], "join")[0]
    return _kernels.join()


def size_op(process_set_id: int = 0, name: Optional[str] = None):
    """The size of the process set with this id (the world's by default), as a tensor."""
    ranks = _basics.STATE.process_set_ranks(process_set_id)
    if ranks is None:
        raise InvalidArgument(f"size_op: no process set has id {process_set_id}")
    return tf.constant(len(ranks), tf.int32, name=name)


def process_set_included_op(process_set_id: int = 0, name: Optional[str] = None):
    """1 where this rank is in the process set with this id, else 0; Horovod's error
    code -3 for an id no set has."""
    ranks = _basics.STATE.process_set_ranks(process_set_id)
    value = -3 if ranks is None else int(_basics.rank() in ranks)
    return tf.constant(value, tf.int32, name=name)


def rank_op():
    return tf.constant(_basics.rank(), tf.int32)


def local_size_op():
    return tf.constant(_basics.local_size(), tf.int32)


def local_rank_op():
    return tf.constant(_basics.local_rank(), tf.int32)
