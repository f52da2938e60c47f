"""Independent collectives in one TensorFlow graph, run by inter-op threads that may
pick them in any order (see test_tf_graph_order.py).  Each rank runs 2 inter-op
threads; every result is checked against numpy."""
from __future__ import annotations

import os

import numpy as np

from _tf_support import run_named

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

CHECKS = {}
OPS, REPS = 16, 20


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def _setup():
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(2)
    import horovod_spark.tensorflow as hvd

    hvd.init()
    return tf, hvd, hvd.rank(), hvd.size()


def _inputs(r: int) -> list:
    return [np.full(i + 1, r + 10.0 * i, np.float32) for i in range(OPS)]


def _collectives(tf, hvd, xs, order) -> dict:
    """Op i: an allreduce (odd i) or an allgather (even i) of xs[i], made in `order`."""
    return {i: hvd.allreduce(xs[i], op=hvd.Sum, name=f"order.{i}") if i % 2 else
            hvd.allgather(xs[i], name=f"order.{i}") for i in order}


def _expected(n: int) -> list:
    every = [_inputs(q) for q in range(n)]
    return [np.sum([e[i] for e in every], 0) if i % 2 else np.concatenate([e[i] for e in every])
            for i in range(OPS)]


def _same(got: list, n: int) -> None:
    for i, (g, w) in enumerate(zip(got, _expected(n))):
        assert np.array_equal(np.asarray(g), w), (i, g, w)


@check
def independent_ops_in_a_tf_function_run_repeatedly():
    tf, hvd, r, n = _setup()

    @tf.function
    def step(*xs):
        made = _collectives(tf, hvd, xs, range(OPS))
        return [made[i] for i in range(OPS)]

    xs = [tf.constant(x) for x in _inputs(r)]
    for _ in range(REPS):
        _same(step(*xs), n)


@check
def independent_ops_in_a_v1_graph_made_in_another_order_on_each_rank():
    tf, hvd, r, n = _setup()
    graph = tf.Graph()
    with graph.as_default():
        xs = [tf.constant(x) for x in _inputs(r)]
        order = range(OPS) if r % 2 == 0 else reversed(range(OPS))
        made = _collectives(tf, hvd, xs, list(order))
        fetch = [made[i] for i in range(OPS)]
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=2)
    with tf.compat.v1.Session(graph=graph, config=config) as sess:
        for _ in range(REPS):
            _same(sess.run(fetch), n)


@check
def a_mismatch_in_a_v1_graph_fails_on_every_rank_naming_the_tensor():
    tf, hvd, r, n = _setup()
    graph = tf.Graph()
    with graph.as_default():
        y = hvd.allreduce(tf.ones([2 + r]), name="order.mismatch")
    with tf.compat.v1.Session(graph=graph) as sess:
        try:
            sess.run(y)
        except tf.errors.FailedPreconditionError as exc:
            assert "order.mismatch" in str(exc), exc
        else:
            raise AssertionError("no error")


def run_all(names=None) -> dict:
    """Run the checks (all, or those named); {name: "ok" or the traceback}."""
    return run_named(CHECKS, names)
