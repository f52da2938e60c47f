"""Checks of process sets in horovod_spark.tensorflow and Keras, run in every rank of one
launch of 3 ranks on hosts a, a, b (see test_tf_process_sets.py): ops on sets eagerly and
in a tf.function, a refused non-member, two sets at once, DistributedGradientTape and
the Keras DistributedOptimizer on a set, dynamic add and remove.

The sets: [0, 1] (one host: shared memory), [1, 2] (across hosts: TCP), [0, 2].
"""
from __future__ import annotations

import os
import threading
import traceback

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

SETS = [[0, 1], [1, 2], [0, 2]]
CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def data(r: int, shape, tag: int = 0) -> np.ndarray:
    n = int(np.prod(shape))
    return ((np.arange(n) % 7) + 10 * r + tag).reshape(shape).astype(np.float32)


@check
def eager_ops_on_a_set_match_numpy(hvd, tf, sets):
    r = hvd.rank()
    for ps in sets:
        if r not in ps.ranks:
            continue
        members, me = ps.ranks, ps.ranks.index(r)
        total = sum(data(k, (4,)) for k in members)
        np.testing.assert_array_equal(hvd.allreduce(data(r, (4,)), op=hvd.Sum, process_set=ps), total)
        np.testing.assert_allclose(hvd.allreduce(data(r, (4,)), process_set=ps), total / 2)
        got = hvd.allreduce(tf.constant([2 * r + 1], tf.int32), process_set=ps)  # truncated
        assert got.numpy().tolist() == [int(sum(2 * k + 1 for k in members) / 2)], got
        g = hvd.grouped_allreduce([data(r, (2,)), data(r, (3,), 1)], op=hvd.Sum, process_set=ps)
        np.testing.assert_array_equal(g[1], sum(data(k, (3,), 1) for k in members))
        gathered = hvd.allgather(np.full((me + 1, 2), r, np.float32), process_set=ps)
        assert gathered.numpy()[:, 0].tolist() == [k for i, k in enumerate(members) for _ in range(i + 1)]
        for root in members:
            b = hvd.broadcast(data(r, (3,)), root_rank=root, process_set=ps)
            np.testing.assert_array_equal(b, data(root, (3,)))
        out, recv = hvd.alltoall(np.full((3,), r, np.float32), splits=[1, 2], process_set=ps)
        assert recv.numpy().tolist() == [me + 1] * 2
        assert out.numpy().tolist() == [k for k in members for _ in range(me + 1)]
        rs = hvd.reducescatter(data(r, (5, 2)), op=hvd.Sum, process_set=ps)
        start = 0 if me == 0 else 3
        np.testing.assert_array_equal(rs, sum(data(k, (5, 2)) for k in members)[start:start + rs.shape[0]])
        ga, = hvd.grouped_allgather([np.array([r], np.float32)], process_set=ps)
        assert ga.numpy().tolist() == members
        grs, = hvd.grouped_reducescatter([data(r, (2, 2))], op=hvd.Sum, process_set=ps)
        np.testing.assert_array_equal(grs, sum(data(k, (2, 2)) for k in members)[me:me + 1])
        assert hvd.broadcast_object({"r": r}, members[0], process_set=ps) == {"r": members[0]}
        assert hvd.allgather_object(r, process_set=ps) == members
        v = tf.Variable(data(r, (2,)))
        hvd.broadcast_variables([v], root_rank=members[-1], process_set=ps)
        np.testing.assert_array_equal(v.numpy(), data(members[-1], (2,)))
        hvd.barrier(process_set=ps)


@check
def size_and_included_ops_by_id(hvd, tf, sets):
    r = hvd.rank()
    assert int(hvd.size_op()) == 3 and int(hvd.process_set_included_op()) == 1
    for ps in sets:
        assert int(hvd.size_op(process_set_id=ps.process_set_id)) == 2
        assert int(hvd.process_set_included_op(ps.process_set_id)) == int(r in ps.ranks)
    assert int(hvd.process_set_included_op(99)) == -3  # Horovod's unknown-set code


@check
def traced_ops_on_a_set_and_their_gradients(hvd, tf, sets):
    r, ps = hvd.rank(), sets[1]
    if r not in ps.ranks:
        return

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = hvd.allreduce(x * 2.0, op=hvd.Sum, process_set=ps)
            loss = tf.reduce_sum(hvd.allgather(x, process_set=ps)) + tf.reduce_sum(y)
        return y, tape.gradient(loss, x)

    for _ in range(2):  # the second run: the op's steady state
        y, g = step(tf.constant(data(r, (3,))))
        np.testing.assert_array_equal(y, 2 * sum(data(k, (3,)) for k in ps.ranks))
        # d/dx: the allgather's averaged gradient (1), the Sum allreduce's (2 * 2 ranks)
        np.testing.assert_array_equal(g, np.full(3, 1.0 + 2 * 2, np.float32))


@check
def a_rank_outside_a_set_is_refused(hvd, tf, sets):
    r = hvd.rank()
    for ps in sets:
        if r in ps.ranks:
            continue
        try:
            hvd.allreduce(np.ones(2, np.float32), process_set=ps)
        except tf.errors.InvalidArgumentError as exc:
            assert isinstance(exc, ValueError) and f"world rank {r} is not a member" in str(exc), exc
        else:
            raise AssertionError(f"an op on {ps} ran on rank {r}")


@check
def two_sets_at_once_from_two_threads(hvd, tf, sets):
    r, errors = hvd.rank(), []

    def work(ps):
        try:
            for i in range(10):
                got = hvd.allreduce(np.full(2, r + i, np.float32), op=hvd.Sum,
                                    name=f"threads.{ps.process_set_id}.{i}", process_set=ps)
                assert got.numpy().tolist() == [float(sum(k + i for k in ps.ranks))] * 2
        except BaseException:
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=work, args=(ps,)) for ps in sets if r in ps.ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads) and not errors, errors


@check
def tape_and_keras_optimizer_average_over_the_set(hvd, tf, sets):
    import keras

    r, ps = hvd.rank(), sets[0]
    w = tf.Variable(np.ones(3, np.float32))
    if r not in ps.ranks:  # outside the set: its own gradients, as Horovod's
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.5), process_set=ps)
        opt.apply([tf.constant(data(r, (3,)))], [w])
        np.testing.assert_allclose(w.numpy(), 1 - 0.5 * data(r, (3,)))
        return
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * data(r, (3,)))
    grad, = hvd.DistributedGradientTape(tape, process_set=ps).gradient(loss, [w])
    np.testing.assert_allclose(grad, sum(data(k, (3,)) for k in ps.ranks) / 2)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.5), process_set=ps)
    opt.apply([tf.constant(data(r, (3,)))], [w])
    np.testing.assert_allclose(w.numpy(), 1 - 0.5 * sum(data(k, (3,)) for k in ps.ranks) / 2)


@check
def dynamic_sets_are_added_and_removed(hvd, tf, sets):
    r, old = hvd.rank(), sets[2]
    assert hvd.remove_process_set(old) is True and old.process_set_id is None
    ps = hvd.add_process_set([2, 0])
    assert ps.process_set_id == 3 and ps.ranks == [0, 2], ps
    if r in ps.ranks:
        assert hvd.allreduce(np.ones(1, np.float32), op=hvd.Sum, process_set=ps).numpy() == 2
    assert hvd.remove_process_set(ps) is True


def run_all() -> dict:
    import tensorflow as tf
    import horovod_spark.tensorflow as hvd

    hvd.init(process_sets="dynamic")
    sets = [hvd.add_process_set(s) for s in SETS[:2]] + [hvd.add_process_set(hvd.ProcessSet(SETS[2]))]
    results = {}
    for name, fn in CHECKS.items():
        try:
            fn(hvd, tf, sets)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    hvd.shutdown()
    return results
