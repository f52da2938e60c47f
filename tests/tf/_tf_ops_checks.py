"""Checks of horovod_spark.tensorflow run inside every rank (see test_tf_ops.py).

`run_all()` runs every check and returns {check name: "ok" or the traceback},
so one launch of TensorFlow serves many tests.  Every rank can compute every
other rank's input (`value(r)`), so each result is compared against numpy.
"""
from __future__ import annotations

import os

import numpy as np

from _tf_support import run_named

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def value(r, shape=(3, 4), dtype=np.float32):
    """Rank r's input: distinct per rank, exact in float16."""
    n = int(np.prod(shape))
    return ((np.arange(n) % 7 + 1) * (r + 1) - 3 * r).reshape(shape).astype(dtype)


def close(actual, expected, tol=1e-6):
    actual = np.asarray(actual)
    np.testing.assert_allclose(actual.astype(np.float64), np.asarray(expected, np.float64),
                               rtol=tol, atol=tol)


def _setup():
    import tensorflow as tf
    import horovod_spark.tensorflow as hvd

    hvd.init()  # a no-op after the first call
    return tf, hvd, hvd.rank(), hvd.size()


@check
def not_initialized_is_a_clear_error():
    import horovod_spark.tensorflow as hvd

    assert not hvd.is_initialized()
    try:
        hvd.rank()
    except ValueError as exc:
        assert "hvd.init()" in str(exc), exc
    else:
        raise AssertionError("rank() before init() did not raise")
    hvd.init()
    assert hvd.is_initialized()


@check
def placement_matches_the_launcher():
    tf, hvd, r, n = _setup()
    assert (r, n) == (int(os.environ["HVS_RANK"]), int(os.environ["HVS_SIZE"]))
    assert hvd.local_rank() == r and hvd.local_size() == n
    assert hvd.cross_rank() == 0 and hvd.cross_size() == 1
    assert int(hvd.rank_op()) == r and int(hvd.size_op()) == n


@check
def ops_run_through_the_fusion_engine():
    from horovod_spark.tensorflow import _basics

    _setup()
    assert _basics.engine() is not None, "no fusion engine"


@check
def allreduce_every_op_and_dtype_matches_numpy():
    tf, hvd, r, n = _setup()
    every = lambda dt: np.stack([value(q, dtype=dt) for q in range(n)])  # noqa: E731
    for dt in (np.float32, np.float64, np.float16, np.int32, np.int64):
        x = tf.constant(value(r, dtype=dt))
        close(hvd.allreduce(x, op=hvd.Sum), every(dt).sum(0))
        close(hvd.allreduce(x, op=hvd.Min), every(dt).min(0))
        close(hvd.allreduce(x, op=hvd.Max), every(dt).max(0))
        close(hvd.allreduce(x, op=hvd.Product), every(dt).prod(0))
        avg = hvd.allreduce(x)
        assert avg.dtype == x.dtype and avg.shape == x.shape
        if np.issubdtype(dt, np.floating):
            close(avg, every(dt).sum(0) / n, 1e-3 if dt == np.float16 else 1e-6)
        else:  # Horovod: integer average truncates toward zero
            close(avg, np.trunc(every(dt).sum(0) / n))
    bf = hvd.allreduce(tf.constant(value(r), tf.bfloat16), op=hvd.Sum)
    assert bf.dtype == tf.bfloat16
    close(tf.cast(bf, tf.float32), every(np.float32).sum(0), 1e-2)


@check
def allreduce_scalars_empties_and_scale_factors():
    tf, hvd, r, n = _setup()
    scalar = hvd.allreduce(tf.constant(float(r + 1)), op=hvd.Sum)
    assert scalar.shape == (), scalar.shape
    close(scalar, n * (n + 1) / 2)
    assert hvd.broadcast(tf.constant(r), 0).shape == ()
    empty = hvd.allreduce(tf.zeros([0, 3]))
    assert empty.shape == (0, 3)
    x = tf.constant(value(r))
    total = sum(value(q) for q in range(n))
    close(hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0), total * 1.5)
    close(hvd.allreduce(x, average=False), total)
    close(hvd.allreduce(x, average=True), total / n)


@check
def fp16_compression_keeps_the_dtype_and_the_value():
    tf, hvd, r, n = _setup()
    x = tf.constant(value(r) / 8)
    y = hvd.allreduce(x, compression=hvd.Compression.fp16)
    assert y.dtype == tf.float32
    close(y, sum(value(q) for q in range(n)) / 8 / n, 1e-3)
    ints = hvd.allreduce(tf.constant([r, 1]), op=hvd.Sum, compression=hvd.Compression.fp16)
    assert ints.dtype == tf.int32 and ints.numpy().tolist() == [n * (n - 1) // 2, n]


@check
def grouped_allreduce_of_mixed_dtypes_matches_numpy():
    tf, hvd, r, n = _setup()
    xs = [tf.constant(value(r, (5,))), tf.constant(value(r, (2, 2), np.float64)),
          tf.constant(value(r, (3,), np.int32)), tf.constant(value(r, (4,)))]
    out = hvd.grouped_allreduce(xs, op=hvd.Sum)
    for x, y in zip(xs, out):
        assert y.dtype == x.dtype and y.shape == x.shape
    close(out[0], sum(value(q, (5,)) for q in range(n)))
    close(out[1], sum(value(q, (2, 2)) for q in range(n)))
    close(out[2], sum(value(q, (3,)) for q in range(n)))
    close(out[3], sum(value(q, (4,)) for q in range(n)))


@check
def allgather_with_different_first_dims_matches_numpy():
    tf, hvd, r, n = _setup()
    rows = lambda q: q + 1  # noqa: E731
    x = tf.constant(value(r, (rows(r), 3)))
    close(hvd.allgather(x), np.concatenate([value(q, (rows(q), 3)) for q in range(n)]))
    ints = hvd.allgather(tf.constant([r] * rows(r), tf.int64))
    assert ints.dtype == tf.int64
    assert ints.numpy().tolist() == [q for q in range(n) for _ in range(rows(q))]
    close(hvd.allgather(tf.constant(float(r))), np.arange(n))
    none = hvd.allgather(tf.zeros([0, 2]) if r == 0 else tf.ones([1, 2]))
    assert none.shape == (n - 1, 2)


@check
def broadcast_from_every_root_matches_numpy():
    tf, hvd, r, n = _setup()
    for root in range(n):
        close(hvd.broadcast(tf.constant(value(r)), root), value(root))
    assert hvd.broadcast(tf.constant([r], tf.int8), n - 1).numpy().tolist() == [n - 1]


@check
def alltoall_with_and_without_splits_matches_numpy():
    tf, hvd, r, n = _setup()
    x = tf.constant(np.arange(2 * n) + 100 * r)
    out = hvd.alltoall(x)  # without splits: the tensor alone, as Horovod's
    assert out.numpy().tolist() == [100 * q + 2 * r + k for q in range(n) for k in range(2)]
    splits = lambda q: [(q + j) % 3 for j in range(n)]  # noqa: E731  rows q sends to j
    x = tf.constant(value(r, (sum(splits(r)), 2)))
    out, recv = hvd.alltoall(x, splits=splits(r))
    assert recv.numpy().tolist() == [splits(q)[r] for q in range(n)]
    expect = []
    for q in range(n):
        start = sum(splits(q)[:r])
        expect.append(value(q, (sum(splits(q)), 2))[start:start + splits(q)[r]])
    close(out, np.concatenate(expect))


@check
def reducescatter_gives_each_rank_its_rows():
    tf, hvd, r, n = _setup()
    x = tf.constant(value(r, (2 * n + 1, 3)))
    total = sum(value(q, (2 * n + 1, 3)) for q in range(n))
    rows = [2 + (1 if q < 1 else 0) for q in range(n)]
    start = sum(rows[:r])
    mine = total[start:start + rows[r]]
    close(hvd.reducescatter(x, op=hvd.Sum), mine)
    avg = hvd.reducescatter(x)  # Horovod's default: Average
    assert avg.shape == (rows[r], 3)
    close(avg, mine / n)
    close(hvd.reducescatter(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25), mine / 2)


@check
def ops_inside_tf_function_match_eager_and_keep_static_shapes():
    tf, hvd, r, n = _setup()

    @tf.function
    def step(x):
        s = hvd.allreduce(x, op=hvd.Sum)
        assert s.shape == (3, 4), s.shape
        g = hvd.allgather(x[: r + 1])
        assert g.shape.as_list() == [None, 4]
        b = hvd.broadcast(x, n - 1)
        rs = hvd.reducescatter(x, op=hvd.Sum)
        a, recv = hvd.alltoall(tf.reshape(x, [-1])[: 2 * n], splits=[2] * n)
        grouped = hvd.grouped_allreduce([x, 2 * x], op=hvd.Sum)
        return s, g, b, rs, a, recv, grouped

    x = tf.constant(value(r))
    for _ in range(2):  # the second call reuses the traced graph
        s, g, b, rs, a, recv, grouped = step(x)
        total = sum(value(q) for q in range(n))
        close(s, total)
        close(g, np.concatenate([value(q)[: q + 1] for q in range(n)]))
        close(b, value(n - 1))
        rows = [3 // n + (1 if q < 3 % n else 0) for q in range(n)]
        close(rs, total[sum(rows[:r]):sum(rows[:r + 1])])
        close(a, np.concatenate([value(q).reshape(-1)[2 * r:2 * r + 2] for q in range(n)]))
        assert recv.numpy().tolist() == [2] * n
        close(grouped[1], 2 * total)


def _coeff(q, shape):
    return (np.arange(int(np.prod(shape))).reshape(shape) % 5 + q + 1).astype(np.float32)


@check
def gradients_of_the_ops_are_horovods():
    tf, hvd, r, n = _setup()
    x = tf.Variable(value(r))
    c = [_coeff(q, (3, 4)) for q in range(n)]
    with tf.GradientTape(persistent=True) as tape:
        loss_sum = tf.reduce_sum(c[r] * hvd.allreduce(x, op=hvd.Sum))
        loss_avg = tf.reduce_sum(c[r] * hvd.allreduce(x, prescale_factor=2.0))
        loss_b = tf.reduce_sum(c[r] * hvd.broadcast(x, 0))
        loss_rs = tf.reduce_sum(c[r][: 3 // n + (r < 3 % n)] * hvd.reducescatter(x, op=hvd.Sum))
    close(tape.gradient(loss_sum, x), sum(c))
    close(tape.gradient(loss_avg, x), 2.0 * sum(c) / n)
    close(tape.gradient(loss_b, x), sum(c) / n if r == 0 else np.zeros((3, 4)), 1e-5)
    rows = [3 // n + (1 if q < 3 % n else 0) for q in range(n)]
    close(tape.gradient(loss_rs, x), n * np.concatenate([c[q][: rows[q]] for q in range(n)]))

    rows_g = [q + 1 for q in range(n)]
    y = tf.Variable(value(r, (rows_g[r], 2)))
    cg = [_coeff(q, (sum(rows_g), 2)) for q in range(n)]
    with tf.GradientTape() as tape:
        loss_g = tf.reduce_sum(cg[r] * hvd.allgather(y))
    start = sum(rows_g[:r])
    close(tape.gradient(loss_g, y), sum(cg)[start:start + rows_g[r]] / n, 1e-5)


@check
def gradient_of_alltoall_sends_the_gradient_back():
    tf, hvd, r, n = _setup()
    splits = [(r + j) % 2 + 1 for j in range(n)]
    x = tf.Variable(value(r, (sum(splits), 2)))
    with tf.GradientTape() as tape:
        out, recv = hvd.alltoall(x, splits=splits)
        loss = tf.reduce_sum(out * (r + 1.0))
    # the rows x sends to rank j come back scaled by j + 1
    expect = np.concatenate([np.full((splits[j], 2), j + 1.0) for j in range(n)])
    close(tape.gradient(loss, x), expect)


@check
def min_max_product_have_no_gradient():
    tf, hvd, r, n = _setup()
    x = tf.Variable([1.0, 2.0])
    with tf.GradientTape() as tape:
        y = hvd.allreduce(x, op=hvd.Max)
    try:
        tape.gradient(y, x)
    except NotImplementedError as exc:
        assert "max" in str(exc), exc
    else:
        raise AssertionError("the gradient of a max allreduce did not raise")


def _linear_grads(tf, hvd, r, n, tape_kwargs):
    w = tf.Variable(np.ones((4, 1), np.float32))
    xs = [value(q, (6, 4)) / 10 for q in range(n)]

    def local(q):  # numpy gradient of mean((x w)^2) on rank q's data
        return 2 * xs[q].T @ (xs[q] @ w.numpy()) / xs[q].shape[0]

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.matmul(x, w)))
        tape = hvd.DistributedGradientTape(tape, **tape_kwargs)
        return tape.gradient(loss, [w])[0]

    return step, tf.constant(xs[r]), [local(q) for q in range(n)]


@check
def distributed_gradient_tape_averages_eagerly_and_in_tf_function():
    tf, hvd, r, n = _setup()
    step, x, local = _linear_grads(tf, hvd, r, n, {})
    close(step(x), sum(local) / n, 1e-5)
    close(tf.function(step)(x), sum(local) / n, 1e-5)
    step, x, local = _linear_grads(tf, hvd, r, n, {"op": hvd.Sum, "compression": hvd.Compression.fp16})
    close(tf.function(step)(x), sum(local), 1e-2)
    step, x, local = _linear_grads(tf, hvd, r, n, {"gradient_predivide_factor": 2.0})
    close(tf.function(step)(x), sum(local) / n, 1e-5)


@check
def two_distributed_tapes_over_one_variable_in_one_tf_function():
    tf, hvd, r, n = _setup()
    w = tf.Variable([1.0, 2.0])

    @tf.function
    def two_losses():
        with tf.GradientTape() as t1:
            a = tf.reduce_sum(w) * (r + 1)
        with tf.GradientTape() as t2:
            b = tf.reduce_sum(w * w) * (r + 1)
        ga = hvd.DistributedGradientTape(t1, op=hvd.Sum).gradient(a, [w, 2 * w])
        gb = hvd.DistributedGradientTape(t2, op=hvd.Sum).gradient(b, [w])
        return ga[0], gb[0]

    total = n * (n + 1) / 2
    for _ in range(3):
        ga, gb = two_losses()
        close(ga, [total, total])
        close(gb, [2 * total, 4 * total])


@check
def distributed_gradient_tape_keeps_nesting_and_none_gradients():
    tf, hvd, r, n = _setup()
    a, b, unused = tf.Variable(1.0), tf.Variable([2.0, 3.0]), tf.Variable(5.0)
    with tf.GradientTape() as tape:
        loss = (r + 1) * a + tf.reduce_sum(b) * (r + 1)
    tape = hvd.DistributedGradientTape(tape, op=hvd.Sum, groups=2)
    grads = tape.gradient(loss, {"a": a, "rest": [b, unused]})
    total = n * (n + 1) / 2
    close(grads["a"], total)
    close(grads["rest"][0], [total, total])
    assert grads["rest"][1] is None



@check
def allreduce_in_tf_function_runs_the_native_op_through_the_lane():
    """Inside a tf.function a dense float allreduce is the native op (lane_op.cc): after
    its first run the engine's lane runs it without Python, with the bits of the
    tf.numpy_function path (HOROVOD_SPARK_TF_LANE=0), which the same steps repeat."""
    from horovod_spark.tensorflow import _basics, _lane_op

    tf, hvd, r, n = _setup()
    eng = _basics.engine()

    def step_fn():
        @tf.function
        def step(x):
            return hvd.allreduce(x, name="lane.step", op=hvd.Average, postscale_factor=0.5)
        return step

    def kinds(fn, x):
        return {op.type for op in fn.get_concrete_function(x).graph.get_operations()}

    xs = [tf.constant(value(r, (64, 33)) + k) for k in range(12)]
    fast = step_fn()
    assert "HvsLaneAllreduce" in kinds(fast, xs[0]), kinds(fast, xs[0])
    before = eng.metrics()["lane_cycles"]
    got = [fast(x).numpy() for x in xs]
    lane_cycles = eng.metrics()["lane_cycles"] - before
    assert lane_cycles >= len(xs) // 2, lane_cycles  # the first run armed it
    for k, g in enumerate(got):
        want = sum(value(q, (64, 33)) + k for q in range(n)) / n * 0.5
        close(g, want)
    # HOROVOD_SPARK_TF_LANE=0, as this rank's process read it at its first traced allreduce
    _lane_op._state["enabled"] = False
    try:
        slow = step_fn()
        assert "HvsLaneAllreduce" not in kinds(slow, xs[0]), kinds(slow, xs[0])
        ref = [slow(x).numpy() for x in xs]
    finally:
        _lane_op._state["enabled"] = True
    for g, w in zip(got, ref):
        np.testing.assert_array_equal(g, w)
    # float16, as Compression.fp16 sends gradients: the lane's postscale rounds like numpy's
    halves = [tf.constant(value(r, (40,), np.float16) + k) for k in range(6)]

    @tf.function
    def half_step(x):
        return hvd.allreduce(x, name="lane.half", op=hvd.Average)

    assert "HvsLaneAllreduce" in kinds(half_step, halves[0])
    before = eng.metrics()["lane_cycles"]
    got16 = [half_step(x).numpy() for x in halves]
    assert eng.metrics()["lane_cycles"] - before >= len(halves) // 2
    for k, g in enumerate(got16):
        total = sum(value(q, (40,), np.float16) + np.float16(k) for q in range(n))
        np.testing.assert_array_equal(g, total * np.float16(1.0 / n))

@check
def a_group_of_one_dtype_travels_packed_and_mixed_dtypes_do_not():
    from horovod_spark.tensorflow import _basics

    tf, hvd, r, n = _setup()
    shapes = [(3, 4), (5,), (), (2, 1, 3)]
    ws = [tf.Variable(np.full(s, 1.0, np.float32)) for s in shapes]
    w64 = tf.Variable(np.ones(4, np.float64))

    @tf.function
    def grads(mixed):
        with tf.GradientTape() as tape:
            loss = sum(tf.reduce_sum(w * (r + 1.0) * (k + 1)) for k, w in enumerate(ws))
            if mixed:
                loss += tf.cast(tf.reduce_sum(w64 * (r + 1.0)), tf.float32)
        tape = hvd.DistributedGradientTape(tape, op=hvd.Sum)
        return tape.gradient(loss, ws + [w64] if mixed else ws)

    total = n * (n + 1) / 2
    eng = _basics.engine()
    for mixed in (False, True):
        before = eng.metrics()["allreduce_tensors"]
        out = grads(mixed)
        got = eng.metrics()["allreduce_tensors"] - before
        for k, (g, s) in enumerate(zip(out, shapes)):
            assert tuple(g.shape) == s and g.dtype == tf.float32
            close(g, np.full(s, total * (k + 1)))
        if mixed:
            assert out[-1].dtype == tf.float64
            close(out[-1], np.full(4, total))
        assert got == (len(ws) + 1 if mixed else 1), (mixed, got)


@check
def sparse_gradients_are_allgathered_or_densified():
    tf, hvd, r, n = _setup()
    table = tf.Variable(np.zeros((5, 2), np.float32))
    ids = tf.constant([r, 4])

    def grad(**kw):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(table, ids)) * (r + 1)
        return hvd.DistributedGradientTape(tape, **kw).gradient(loss, table)

    sparse = grad()
    assert isinstance(sparse, tf.IndexedSlices), type(sparse)
    assert sparse.indices.numpy().tolist() == [i for q in range(n) for i in (q, 4)]
    dense = np.zeros((5, 2))
    for q in range(n):
        dense[[q, 4]] += (q + 1) / n
    close(tf.convert_to_tensor(sparse), dense)
    as_dense = grad(sparse_as_dense=True)
    assert not isinstance(as_dense, tf.IndexedSlices)
    close(as_dense, dense)
    close(tf.convert_to_tensor(hvd.allreduce(sparse, op=hvd.Sum)), dense * n)


@check
def broadcast_variables_and_objects_agree_with_root():
    tf, hvd, r, n = _setup()
    vs = [tf.Variable(value(r)), tf.Variable([r, r], dtype=tf.int64), tf.Variable(float(r))]
    hvd.broadcast_variables(vs, root_rank=n - 1)
    close(vs[0], value(n - 1))
    assert vs[1].numpy().tolist() == [n - 1, n - 1] and float(vs[2].numpy()) == n - 1
    obj = {"rank": r, "data": list(range(r + 3))} if r == 1 else None
    assert hvd.broadcast_object(obj, root_rank=1) == {"rank": 1, "data": [0, 1, 2, 3]}
    assert hvd.allgather_object(("r", r, "x" * r)) == [("r", q, "x" * q) for q in range(n)]

    @tf.function
    def sync(root):
        hvd.broadcast_variables(vs[:1], root)

    vs[0].assign(value(r) * 0 + r)
    sync(0)
    close(vs[0], np.zeros((3, 4)))


@check
def barrier_and_join_return_on_every_rank():
    tf, hvd, r, n = _setup()
    hvd.barrier()
    assert hvd.join() in range(n)


@check
def join_lets_a_rank_stop_early():
    tf, hvd, r, n = _setup()
    # rank q runs q + 1 steps; joined ranks contribute zeros to the others' sums
    for step in range(r + 1):
        got = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum, name=f"uneven.{step}")
        close(got, [sum(1 for q in range(n) if q >= step)])
    assert hvd.join() == n - 1


@check
def unsupported_requests_fail_with_a_reason():
    tf, hvd, r, n = _setup()
    from collectives import NotSupported

    adasum = (lambda: hvd.allreduce(tf.ones([2]), op=hvd.Adasum), NotSupported) if n & (n - 1) else \
        (lambda: hvd.allreduce(tf.ones([2], tf.int32), op=hvd.Adasum), hvd.InvalidArgument)
    for bad, kind in (adasum,
                      (lambda: hvd.allreduce(tf.ones([2]), op=hvd.Sum, average=True), ValueError),
                      (lambda: hvd.alltoall(tf.ones([n + 1])), ValueError)):
        try:
            bad()
        except kind:
            pass
        else:
            raise AssertionError(f"{bad} did not raise {kind.__name__}")


@check
def the_timeline_records_tf_ops_by_name():
    tf, hvd, r, n = _setup()
    import tempfile

    path = hvd.broadcast_object(os.path.join(tempfile.mkdtemp(), "timeline.json") if r == 0 else None)
    hvd.start_timeline(path)
    hvd.allreduce(tf.ones([16]), name="timeline.probe")
    tf.function(lambda x: hvd.grouped_allreduce([x, x], name="timeline.group"))(tf.ones([4]))
    hvd.stop_timeline()
    if r == 0:
        text = open(path).read()
        assert "timeline.probe" in text and "timeline.group.1" in text, text[:2000]


@check
def a_mismatch_across_ranks_is_named_on_every_rank():
    tf, hvd, r, n = _setup()
    from collectives import MismatchError

    try:
        hvd.allreduce(tf.ones([2 + r]), name="mismatched.grad")
    except MismatchError as exc:
        assert "mismatched.grad" in str(exc), exc
    else:
        raise AssertionError("different shapes under one name did not raise")


def run_all(names=None) -> dict:
    """Run the checks (all, or those named); {name: "ok" or the traceback}."""
    return run_named(CHECKS, names)
