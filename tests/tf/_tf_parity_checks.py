"""Checks that horovod_spark.tensorflow computes what Horovod's TensorFlow API
computes, run in every rank of one launch (see test_tf_parity.py): alltoall's
result, integer Average and scale factors, dtypes, reducescatter's refusal,
IndexedSlices of integers and the error types a script catches.

Every rank builds every rank's input, so each result is checked against numpy.
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


def ints(r: int, n: int = 6, dtype=np.int32) -> np.ndarray:
    """Rank r's integers, both signs."""
    return (np.arange(n) * 3 - 7 + 5 * r).astype(dtype)


def my_rows(total: int, rank: int, size: int) -> slice:
    base, rem = divmod(total, size)
    start = rank * base + min(rank, rem)
    return slice(start, start + base + (1 if rank < rem else 0))


def _setup():
    import tensorflow as tf
    import horovod_spark.tensorflow as hvd

    hvd.init()
    return tf, hvd, hvd.rank(), hvd.size()


@check
def alltoall_without_splits_returns_the_tensor():
    tf, hvd, r, n = _setup()
    x = tf.constant(np.arange(2 * n) + 100 * r)
    want = [100 * q + 2 * r + k for q in range(n) for k in range(2)]
    out = hvd.alltoall(x)
    assert isinstance(out, tf.Tensor) and out.numpy().tolist() == want, out
    traced = tf.function(lambda t: hvd.alltoall(t, name="parity.a2a.traced"))(x)
    assert isinstance(traced, tf.Tensor) and traced.numpy().tolist() == want, traced
    out, recv = hvd.alltoall(x, splits=[2] * n)
    assert recv.dtype == tf.int32 and recv.numpy().tolist() == [2] * n


@check
def integer_average_and_scale_factors_are_horovods():
    tf, hvd, r, n = _setup()
    every = np.stack([ints(q) for q in range(n)]).astype(np.float64)
    got = hvd.allreduce(tf.constant(ints(r)))
    assert got.dtype == tf.int32 and got.numpy().tolist() == np.trunc(every.sum(0) / n).tolist()
    for op, div in ((hvd.Sum, 1), (hvd.Average, n)):
        got = hvd.allreduce(tf.constant(ints(r)), op=op, prescale_factor=2.5, postscale_factor=0.5)
        want = np.trunc(np.trunc(every * 2.5).sum(0) * (0.5 / div))
        assert got.numpy().tolist() == want.tolist(), (op, got, want)
    rows = my_rows(2 * n + 1, r, n)
    big = np.stack([ints(q, 2 * n + 1) for q in range(n)]).astype(np.float64)
    for op, div in ((hvd.Sum, 1), (hvd.Average, n)):  # never silently zeros
        got = hvd.reducescatter(tf.constant(ints(r, 2 * n + 1)), op=op, prescale_factor=3.0,
                                postscale_factor=0.5)
        want = np.trunc(np.trunc(big * 3.0).sum(0) * (0.5 / div))[rows]
        assert got.dtype == tf.int32 and got.numpy().tolist() == want.tolist(), (op, got, want)


@check
def uint16_moves_and_uint8_alltoall_takes_any_splits():
    tf, hvd, r, n = _setup()
    x = tf.constant(np.array([60000 + r, 7], np.uint16))
    got = hvd.allgather(x)
    assert got.dtype == tf.uint16 and got.numpy().tolist() == [v for q in range(n)
                                                              for v in (60000 + q, 7)]
    assert hvd.broadcast(x, n - 1).numpy().tolist() == [60000 + n - 1, 7]
    a = tf.constant(np.full(2 * n, 65000 + r, np.uint16))
    assert hvd.alltoall(a).numpy().tolist() == [65000 + q for q in range(n) for _ in range(2)]
    u = tf.constant(np.arange(3 * n, dtype=np.uint8) + r)
    out, recv = hvd.alltoall(u, splits=[3] * n)
    assert out.dtype == tf.uint8 and recv.numpy().tolist() == [3] * n
    assert out.numpy().tolist() == [3 * r + k + q for q in range(n) for k in range(3)], out
    empty = tf.zeros([0, 2], tf.uint8)
    out, recv = hvd.alltoall(empty, splits=[0] * n)
    assert out.shape == (0, 2) and recv.numpy().tolist() == [0] * n
    assert hvd.alltoall(empty).shape == (0, 2)


@check
def reducescatter_refuses_a_scalar():
    tf, hvd, r, n = _setup()
    try:
        hvd.reducescatter(tf.constant(1.0))
    except tf.errors.InvalidArgumentError as exc:
        assert isinstance(exc, ValueError) and "0-d" in str(exc), exc
    else:
        raise AssertionError("a 0-d reducescatter did not raise")


@check
def indexed_slices_of_integers_average_as_horovod():
    tf, hvd, r, n = _setup()
    s = tf.IndexedSlices(tf.constant([[r + 1, -3]], tf.int32), tf.constant([r], tf.int64),
                         dense_shape=tf.constant([n, 2], tf.int64))
    got = hvd.allreduce(s)  # values / size, a true division: floats, as Horovod's
    want = np.array([[q + 1, -3] for q in range(n)], np.float64) / n
    np.testing.assert_allclose(got.values.numpy(), want)
    assert got.indices.numpy().tolist() == list(range(n))
    summed = hvd.allreduce(s, op=hvd.Sum)
    assert summed.values.dtype == tf.int32


@check
def gradients_of_allgather_broadcast_and_reducescatter_are_horovods():
    tf, hvd, r, n = _setup()
    x = tf.Variable(tf.ones([2 * n, 2]))
    with tf.GradientTape(persistent=True) as tape:
        ls = tf.reduce_sum(hvd.reducescatter(x, op=hvd.Sum) * (r + 1.0))
        la = tf.reduce_sum(hvd.reducescatter(x, op=hvd.Average) * (r + 1.0))
        lg = tf.reduce_sum(hvd.allgather(x) * (r + 1.0))
        lb = tf.reduce_sum(hvd.broadcast(x, 0) * (r + 1.0))
    per_row = np.repeat([q + 1.0 for q in range(n)], 2)[:, None] * np.ones((1, 2))
    np.testing.assert_allclose(tape.gradient(ls, x).numpy(), n * per_row)
    np.testing.assert_allclose(tape.gradient(la, x).numpy(), per_row)
    mean = sum(q + 1.0 for q in range(n)) / n
    np.testing.assert_allclose(tape.gradient(lg, x).numpy(), np.full((2 * n, 2), mean))
    np.testing.assert_allclose(tape.gradient(lb, x).numpy(),
                               np.full((2 * n, 2), mean if r == 0 else 0.0))


@check
def errors_are_the_types_horovod_scripts_catch():
    tf, hvd, r, n = _setup()
    cases = [(tf.errors.FailedPreconditionError,
              lambda: hvd.allreduce(tf.ones([2 + r]), name="parity.shape")),
             (tf.errors.FailedPreconditionError,
              lambda: hvd.allgather(tf.ones([2], tf.float32 if r else tf.float64),
                                    name="parity.dtype")),
             (tf.errors.InvalidArgumentError,
              lambda: hvd.alltoall(tf.ones([n + 1]), splits=[1] * n)),
             (tf.errors.InvalidArgumentError, lambda: hvd.alltoall(tf.ones([n + 1])))]
    for kind, call in cases:
        try:
            call()
        except kind as exc:
            assert str(exc), kind
        else:
            raise AssertionError(f"{call} did not raise {kind.__name__}")
    hvd.barrier()


@check
def grouped_allgather_and_reducescatter_match_numpy():
    tf, hvd, r, n = _setup()
    a, b = tf.fill([r + 1, 2], float(r)), tf.constant(np.arange(3) + 10 * r)
    ga, gb = hvd.grouped_allgather([a, b], name="parity.gag")
    assert ga[:, 0].numpy().tolist() == [float(q) for q in range(n) for _ in range(q + 1)]
    assert gb.numpy().tolist() == [10 * q + i for q in range(n) for i in range(3)]
    rows = my_rows(2 * n + 1, r, n)
    xs = [ints(r, 2 * n + 1).astype(np.float64), ints(r, 2 * n + 1)]
    outs = hvd.grouped_reducescatter([tf.constant(x) for x in xs], op=hvd.Average)
    every = np.stack([ints(q, 2 * n + 1) for q in range(n)]).astype(np.float64)
    np.testing.assert_allclose(outs[0].numpy(), (every.sum(0) / n)[rows])
    assert outs[1].numpy().tolist() == np.trunc(every.sum(0) / n)[rows].tolist()
    x = tf.Variable(tf.ones([2 * n]))
    with tf.GradientTape() as tape:
        (y,) = hvd.grouped_reducescatter([x], op=hvd.Sum)
        loss = tf.reduce_sum(y)
    np.testing.assert_allclose(tape.gradient(loss, x).numpy(), np.full(2 * n, float(n)))


@check
def broadcast_in_place_and_object_fn_use_the_roots_values():
    tf, hvd, r, n = _setup()
    vs = [tf.Variable([float(r)] * 3), tf.Variable(r + 10)]
    got = hvd.broadcast_(vs, root_rank=n - 1)
    assert vs[0].numpy().tolist() == [n - 1.0] * 3 and int(vs[1].numpy()) == n + 9
    assert got[0].numpy().tolist() == [n - 1.0] * 3
    fn = hvd.broadcast_object_fn(root_rank=0, name="parity.objfn")
    assert fn({"from": r}) == {"from": 0}


def _two_layers(tf, r):
    import keras

    shared, local = keras.layers.Dense(1, use_bias=False), keras.layers.Dense(1, use_bias=False)
    x = tf.constant([[1.0, 2.0]])
    shared(x), local(x)
    shared.kernel.assign([[1.0], [1.0]])
    local.kernel.assign([[r + 1.0], [r + 1.0]])
    return shared, local, x


@check
def partial_tape_and_optimizer_keep_local_gradients():
    tf, hvd, r, n = _setup()
    import keras

    import horovod_spark.keras as hk

    shared, local, x = _two_layers(tf, r)
    with tf.GradientTape() as tape:  # loss (r + 1) * (shared(x) + local(x))
        loss = (r + 1.0) * tf.reduce_sum(shared(x) + local(x))
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=[local])
    g_shared, g_local = tape.gradient(loss, [shared.kernel, local.kernel])
    mean = sum(q + 1.0 for q in range(n)) / n
    np.testing.assert_allclose(g_shared.numpy(), [[mean], [2 * mean]])
    np.testing.assert_allclose(g_local.numpy(), [[(r + 1.0) / n], [2 * (r + 1.0) / n]])
    opt = hk.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), local_layers=local)
    opt.apply([tf.constant([[r + 1.0], [r + 1.0]])] * 2, [shared.kernel, local.kernel])
    np.testing.assert_allclose(shared.kernel.numpy(), [[1 - mean]] * 2, rtol=1e-6)
    np.testing.assert_allclose(local.kernel.numpy(), [[(r + 1.0) * (1 - 1.0 / n)]] * 2, rtol=1e-6)


@check
def keras_callbacks_and_probes_have_horovods_names():
    tf, hvd, r, n = _setup()
    import keras

    import horovod_spark.keras as hk

    shared, local, x = _two_layers(tf, r)
    shared.kernel.assign([[r * 1.0], [r * 1.0]])
    inp = keras.Input((2,))
    model = keras.Model(inp, shared(inp) + local(inp))
    cb = hk.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[local.kernel])
    cb.set_model(model)
    cb.on_train_begin()
    assert shared.kernel.numpy().tolist() == [[0.0], [0.0]]  # root's
    assert local.kernel.numpy().tolist() == [[r + 1.0], [r + 1.0]]  # each rank's own
    best = hk.callbacks.BestModelCheckpoint(monitor="loss", filepath="unused.keras")
    assert best.save_best_only and best.monitor == "loss"
    for probe in ("mpi_built", "nccl_built", "gloo_built", "ddl_built", "ccl_built",
                  "cuda_built", "rocm_built", "mpi_enabled", "gloo_enabled"):
        assert isinstance(getattr(hk, probe)(), bool), probe
    try:
        hk.broadcast_global_variables(0)
    except RuntimeError as exc:  # TF1 collections, as Horovod's refuses in eager TF2
        assert "broadcast_variables" in str(exc), exc
    else:
        raise AssertionError("broadcast_global_variables did not refuse")


@check
def sync_batch_normalization_matches_batch_normalization_over_every_batch():
    tf, hvd, r, n = _setup()
    import keras

    def batch(q):  # ranks hold different batch sizes
        rng = np.random.default_rng(70 + q)
        return (rng.standard_normal((q + 2, 3)) * (q + 1) + q).astype(np.float32)

    def coeff(q):
        return (np.arange((q + 2) * 3).reshape(q + 2, 3) % 4 - q).astype(np.float32)

    sync = hvd.SyncBatchNormalization(momentum=0.5)
    ref = keras.layers.BatchNormalization(momentum=0.5)
    x = tf.Variable(batch(r))
    full = tf.Variable(np.concatenate([batch(q) for q in range(n)]))
    with tf.GradientTape(persistent=True) as tape:
        y = sync(x, training=True)
        loss = tf.reduce_sum(y * coeff(r))
        y_ref = ref(full, training=True)
        loss_ref = tf.reduce_sum(y_ref * np.concatenate([coeff(q) for q in range(n)]))
    start = sum(q + 2 for q in range(r))
    mine = slice(start, start + r + 2)
    np.testing.assert_allclose(y.numpy(), y_ref.numpy()[mine], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(tape.gradient(loss, x).numpy(),
                               tape.gradient(loss_ref, full).numpy()[mine], rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(sync.moving_mean.numpy(), ref.moving_mean.numpy(), rtol=1e-5)
    np.testing.assert_allclose(sync.moving_variance.numpy(), ref.moving_variance.numpy(),
                               rtol=1e-4)
    traced = tf.function(lambda t: sync(t, training=True))(x)  # as Keras's fit runs it
    np.testing.assert_allclose(traced.numpy(), y.numpy(), rtol=1e-5, atol=1e-5)


@check
def half_scale_factors_scale_in_float32_as_horovod():
    """test_horovod_allreduce_cpu_prescale / _postscale: float16 scaled in float32 math and
    rounded back (integers in float64, truncated, as before)."""
    tf, hvd, r, n = _setup()
    factor = 0.1915194503788923  # Horovod's test: np.random.seed(1234); np.random.uniform()
    for dtype in (tf.float16, tf.bfloat16):
        for dim in (1, 2, 3):
            x = tf.cast(tf.random.stateless_uniform([17] * dim, [1234, dim], -100, 100), dtype)
            f32 = tf.constant(factor, tf.float32)
            summed = hvd.allreduce(x, op=hvd.Sum, prescale_factor=factor)
            one = tf.cast(tf.cast(x, tf.float32) * f32, dtype)
            want = one
            for _ in range(n - 1):  # n equal values added in the dtype, one rounding an add
                want = tf.cast(tf.cast(want, tf.float32) + tf.cast(one, tf.float32), dtype)
            np.testing.assert_array_equal(summed.numpy(), want.numpy(), err_msg=f"pre {dtype}")
            plain = x
            for _ in range(n - 1):
                plain = tf.cast(tf.cast(plain, tf.float32) + tf.cast(x, tf.float32), dtype)
            post = hvd.allreduce(x, op=hvd.Sum, postscale_factor=factor)
            want = tf.cast(tf.cast(plain, tf.float32) * f32, dtype)
            np.testing.assert_array_equal(post.numpy(), want.numpy(), err_msg=f"post {dtype}")
            grouped = hvd.grouped_allreduce([x, tf.cast(x, tf.float32)], op=hvd.Sum,
                                            postscale_factor=factor)
            np.testing.assert_array_equal(grouped[0].numpy(), want.numpy(), err_msg="grouped")


@check
def indexed_slices_refuse_what_horovod_refuses():
    """test_horovod_allreduce_indexed_slices_op_error (and the grouped twin) and
    _prescale_postscale_error: NotImplementedError, before anything is submitted."""
    tf, hvd, r, n = _setup()
    s = tf.IndexedSlices(tf.ones([1, 3]), tf.convert_to_tensor([r]))
    for kw in ({"op": hvd.Min}, {"op": hvd.Max}, {"op": hvd.Product}, {"op": hvd.Adasum},
               {"op": hvd.Sum, "prescale_factor": 0.5}, {"op": hvd.Sum, "postscale_factor": 0.5}):
        for call in (lambda: hvd.allreduce(s, **kw), lambda: hvd.grouped_allreduce([s], **kw)):
            try:
                call()
            except NotImplementedError:
                pass
            else:
                raise AssertionError(f"allreduce of tf.IndexedSlices with {kw} did not raise")
    got = hvd.allreduce(s, op=hvd.Sum)  # nothing was left pending: the next op matches
    assert got.values.shape[0] == n, got


@check
def sync_batch_normalization_takes_horovods_fused_argument():
    """test_horovod_syncbn_cpu builds SyncBatchNormalization(fused=False); True is refused."""
    tf, hvd, r, n = _setup()
    layer = hvd.SyncBatchNormalization(fused=False, momentum=0.5)
    out = layer(tf.ones([2, 3]), training=True)
    assert out.shape == (2, 3), out.shape
    for fused in (True, None):
        try:
            hvd.SyncBatchNormalization(fused=fused)
        except ValueError as exc:
            assert "fused=True" in str(exc), exc
        else:
            raise AssertionError(f"SyncBatchNormalization(fused={fused}) was accepted")


def run_all(names=None) -> dict:
    """Run the checks (all, or those named); {name: "ok" or the traceback}."""
    return run_named(CHECKS, names)
