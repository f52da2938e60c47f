"""Checks of op=hvd.Adasum in horovod_spark.tensorflow and keras, run in every rank
of one launch (see test_tf_adasum.py): eager and traced allreduce in every float
dtype, grouped tensors each on its own, DistributedGradientTape and the Keras
DistributedOptimizer, against the numpy reference of the torch checks, within the
few units in the last place that the torch checks allow (their docstring says why).
"""
from __future__ import annotations

import os
import sys

import numpy as np

from _tf_support import run_named

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch"))
from _torch_adasum_checks import ULPS, reference  # noqa: E402  (the same tree, from the definition)

CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def vec(r: int, n: int, seed: int, dtype=np.float32) -> np.ndarray:
    shared = np.random.default_rng(seed).standard_normal(n)
    return (shared + np.random.default_rng([seed, r]).standard_normal(n)).astype(dtype)


def _setup():
    import tensorflow as tf
    import horovod_spark.tensorflow as hvd

    hvd.init()
    return tf, hvd, hvd.rank(), hvd.size()


def _same(got, want, what: str, eps: float = 0.0) -> None:
    got = np.asarray(got)
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape)
    g, w = got.astype(np.float64), want.astype(np.float64)
    scale = float(np.abs(w).max()) if w.size else 0.0
    off = np.abs(g - w) > ULPS * (eps or np.finfo(want.dtype).eps) * scale
    assert not off.any(), f"{what}: {int(off.sum())} elements off, max diff {np.abs(g - w).max()}"


@check
def allreduce_eager_and_traced_matches_the_reference_tree():
    tf, hvd, r, n = _setup()
    traced = tf.function(lambda t: hvd.allreduce(t, op=hvd.Adasum, name="adasum.traced"))
    for i, dtype in enumerate((np.float16, np.float32, np.float64)):
        for count in (1, 9, 500):
            x = vec(r, count, 10 * i + count, dtype)
            want = reference([vec(q, count, 10 * i + count, dtype) for q in range(n)], dtype)
            _same(hvd.allreduce(tf.constant(x), op=hvd.Adasum).numpy(), want, f"{dtype} x {count}")
            _same(traced(tf.constant(x)).numpy(), want, f"traced {dtype} x {count}")
    rows = [vec(q, 6, 5) for q in range(n)]
    got = hvd.allreduce(tf.cast(tf.constant(rows[r]), tf.bfloat16), op=hvd.Adasum)
    bf = [tf.cast(tf.cast(tf.constant(v), tf.bfloat16), tf.float32).numpy() for v in rows]
    want = tf.cast(tf.constant(reference(bf, np.float32)), tf.bfloat16)
    assert got.dtype == tf.bfloat16, got
    _same(tf.cast(got, tf.float32).numpy(), tf.cast(want, tf.float32).numpy(), "bfloat16",
          eps=2.0 ** -7)


@check
def grouped_tensors_combine_each_with_its_own_dot_products():
    tf, hvd, r, n = _setup()
    every = [[vec(q, k, 40 + k) * (1 + 10 * j) for j, k in enumerate((5, 300, 1))]
             for q in range(n)]
    got = hvd.grouped_allreduce([tf.constant(t) for t in every[r]], op=hvd.Adasum)
    for j, g in enumerate(got):
        _same(g.numpy(), reference([every[q][j] for q in range(n)], np.float32), f"tensor {j}")


@check
def the_tape_and_the_keras_optimizer_combine_gradients_with_adasum():
    tf, hvd, r, n = _setup()
    import keras
    import horovod_spark.keras as hvd_keras

    w = tf.Variable(np.linspace(-1, 1, 4).astype(np.float32))
    b = tf.Variable(np.float32(0.5))
    x, y = vec(r, 4, 77), np.float32(r + 1)
    grads = []
    for q in range(n):  # every rank's local gradients, here
        with tf.GradientTape() as tape:
            loss = (tf.reduce_sum(w * vec(q, 4, 77)) + b - np.float32(q + 1)) ** 2
        grads.append([g.numpy() for g in tape.gradient(loss, [w, b])])
    want = [reference([g[j].reshape(-1) for g in grads], np.float32).reshape(grads[0][j].shape)
            for j in range(2)]
    with tf.GradientTape() as tape:
        loss = (tf.reduce_sum(w * x) + b - y) ** 2
    got = hvd.DistributedGradientTape(tape, op=hvd.Adasum).gradient(loss, [w, b])
    for j in range(2):
        _same(got[j].numpy(), want[j], f"tape gradient {j}")
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(1.0), op=hvd.Adasum)
    start = [w.numpy(), b.numpy()]
    with tf.GradientTape() as tape:
        loss = (tf.reduce_sum(w * x) + b - y) ** 2
    opt.apply_gradients(zip(tape.gradient(loss, [w, b]), [w, b]))
    for j, v in enumerate((w, b)):
        assert np.allclose(v.numpy(), start[j] - want[j], rtol=1e-6, atol=1e-7), (j, v, want[j])


def run_all(names=None) -> dict:
    """Run the checks (all, or those named); {name: "ok" or the traceback}."""
    return run_named(CHECKS, names)
