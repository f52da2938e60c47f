"""Checks of horovod_spark.keras run inside every rank (see test_keras.py).

The reference for distributed training is single-process training on the
global batch: rank r trains on its slice of each global batch, so averaged
gradients equal the global batch's, and the weights must match.  Each rank
computes the reference itself, with plain Keras, after the distributed run.
"""
from __future__ import annotations

import os
import tempfile

import numpy as np

from _tf_support import run_named

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

CHECKS = {}
LOCAL_BATCH = 4
STEPS = 3


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def _setup():
    import keras
    import tensorflow as tf
    import horovod_spark.keras as hvd

    hvd.init()
    return tf, keras, hvd, hvd.rank(), hvd.size()


def _data(n, passes=1, features=5, seed=0):
    """Global data: STEPS global batches of n * passes * LOCAL_BATCH rows."""
    rng = np.random.default_rng(seed)
    rows = STEPS * n * passes * LOCAL_BATCH
    x = rng.normal(size=(rows, features)).astype(np.float32)
    y = (np.sin(x @ rng.normal(size=(features, 1))) + 0.1 * x[:, :1]).astype(np.float32)
    return x, y


def _shard(a, r, n, passes=1):
    """Rank r's rows of every global batch, in step order."""
    return a.reshape(STEPS, n, passes * LOCAL_BATCH, -1)[:, r].reshape(-1, a.shape[-1])


def _mlp(keras, seed, features=5):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((features,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1)])


def _close(a_list, b_list, tol=2e-5):
    for a, b in zip(a_list, b_list):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def _weights(model):
    return [v.numpy() for v in model.weights]


def _reference(keras, make_opt, x, y, batch, epochs=2, seed=0, **fit):
    ref = _mlp(keras, seed)
    ref.compile(optimizer=make_opt(), loss="mse", metrics=["mae"], jit_compile=False)
    hist = ref.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0, **fit)
    return ref, hist.history


@check
def fit_matches_single_process_training_on_the_global_batch():
    tf, keras, hvd, r, n = _setup()
    import horovod_spark.tensorflow as hvd_tf

    x, y = _data(n)
    makers = {"sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
              "adam": lambda: keras.optimizers.Adam(0.01)}
    for label, make in makers.items():
        model = _mlp(keras, seed=100 + r)  # different starts: the callback must sync them
        wrap = hvd.DistributedOptimizer if label == "sgd" else hvd_tf.DistributedOptimizer
        model.compile(optimizer=wrap(make()), loss="mse", metrics=["mae"], jit_compile=False)
        hist = model.fit(_shard(x, r, n), _shard(y, r, n), batch_size=LOCAL_BATCH, epochs=2,
                         shuffle=False, verbose=0,
                         callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                    hvd.callbacks.MetricAverageCallback()])
        ref, ref_hist = _reference(keras, make, x, y, n * LOCAL_BATCH, seed=100)  # rank 0's start
        _close(_weights(model), _weights(ref))
        _close(hist.history["loss"], ref_hist["loss"], 1e-4)
        _close(hist.history["mae"], ref_hist["mae"], 1e-4)
        assert int(model.optimizer.iterations) == 2 * STEPS


@check
def broadcast_callback_syncs_weights_but_keeps_dropout_seeds_per_rank():
    tf, keras, hvd, r, n = _setup()
    keras.utils.set_random_seed(100 + r)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8), keras.layers.Dropout(0.5),
                              keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse",
                  jit_compile=False)
    x, y = _data(n)
    model.fit(_shard(x, r, n), _shard(y, r, n), batch_size=LOCAL_BATCH, epochs=1, verbose=0,
              shuffle=False, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    weights = hvd.allgather_object([v.numpy() for v in model.trainable_variables])
    seeds = hvd.allgather_object([v.numpy() for v in model.non_trainable_variables])
    _close(weights[0], weights[-1], 0)
    assert any(not np.array_equal(a, b) for a, b in zip(seeds[0], seeds[-1])), seeds


@check
def metric_average_callback_averages_every_rank_s_metrics():
    tf, keras, hvd, r, n = _setup()
    local = {}

    class Capture(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            local[epoch] = dict(logs)

    x, y = _data(n)
    model = _mlp(keras, 0)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse",
                  metrics=["mae"], jit_compile=False)
    hist = model.fit(_shard(x, r, n), _shard(y, r, n), batch_size=LOCAL_BATCH, epochs=2,
                     shuffle=False, verbose=0, validation_data=(x[r::n], y[r::n]),
                     callbacks=[Capture(), hvd.callbacks.MetricAverageCallback()])
    everyone = hvd.allgather_object(local)
    for epoch in range(2):
        for key in ("loss", "mae", "val_loss", "val_mae"):
            values = [e[epoch][key] for e in everyone]
            assert len(set(values)) == n, f"{key}: ranks saw the same local value {values}"
            _close([hist.history[key][epoch]], [np.mean(values)], 1e-9)


@check
def backward_passes_per_step_matches_one_step_on_the_combined_batch():
    tf, keras, hvd, r, n = _setup()
    passes = 2
    x, y = _data(n, passes)
    make = lambda: keras.optimizers.SGD(0.1, momentum=0.5)  # noqa: E731
    model = _mlp(keras, 0)
    opt = hvd.DistributedOptimizer(make(), backward_passes_per_step=passes,
                                   average_aggregated_gradients=True)
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    model.fit(_shard(x, r, n, passes), _shard(y, r, n, passes), batch_size=LOCAL_BATCH,
              epochs=2, shuffle=False, verbose=0)
    ref, _ = _reference(keras, make, x, y, n * passes * LOCAL_BATCH)
    _close(_weights(model), _weights(ref))
    assert int(opt.iterations) == 2 * STEPS * passes  # every pass counts, as in Keras and Horovod


@check
def backward_passes_per_step_works_eagerly_with_apply_gradients():
    tf, keras, hvd, r, n = _setup()
    w = keras.Variable(np.zeros(3, np.float32))
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2)
    grads = lambda step: np.full(3, (r + 1) * (step + 1), np.float32)  # noqa: E731
    for step in range(4):
        opt.apply_gradients([(tf.constant(grads(step)), w)])
        if step == 0:
            _close([w.numpy()], [np.zeros(3)])  # the first pass only accumulates
    # two updates, each the rank average of a sum of two passes (no averaging over passes)
    mean_rank = np.mean([q + 1 for q in range(n)])
    _close([w.numpy()], [np.full(3, -mean_rank * (1 + 2 + 3 + 4))])


@check
def sparse_embedding_gradients_train_like_the_global_batch():
    tf, keras, hvd, r, n = _setup()
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 10, size=(STEPS * n * LOCAL_BATCH, 3))
    y = rng.normal(size=(len(ids), 1)).astype(np.float32)

    def build(seed):
        keras.utils.set_random_seed(seed)
        return keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(10, 4),
                                 keras.layers.Flatten(), keras.layers.Dense(1)])

    ref = build(0)
    ref.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse", jit_compile=False)
    ref.fit(ids, y, batch_size=n * LOCAL_BATCH, epochs=1, shuffle=False, verbose=0)
    for dense in (False, True):
        model = build(0)
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.5),
                                                         sparse_as_dense=dense),
                      loss="mse", jit_compile=False)
        model.fit(_shard(ids, r, n), _shard(y, r, n), batch_size=LOCAL_BATCH, epochs=1,
                  shuffle=False, verbose=0)
        _close(_weights(model), _weights(ref))


@check
def mixed_precision_overflow_on_one_rank_skips_the_step_on_every_rank():
    tf, keras, hvd, r, n = _setup()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = _mlp(keras, 0)
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
        model.compile(optimizer=opt, loss="mse", jit_compile=False)
        assert model.optimizer is opt and isinstance(opt, keras.optimizers.LossScaleOptimizer)
        x, y = _data(n)
        x, y = _shard(x, r, n), _shard(y, r, n)
        before = _weights(model)
        big = x * (1e5 if r == n - 1 else 1.0)  # float16 gradients overflow on one rank only
        model.fit(big[:LOCAL_BATCH], y[:LOCAL_BATCH], batch_size=LOCAL_BATCH, epochs=1, verbose=0)
        _close(_weights(model), before, 0)  # every rank skipped the step
        scales = hvd.allgather_object(float(opt.dynamic_scale.numpy()))
        assert len(set(scales)) == 1 and scales[0] < opt.initial_scale, scales
        model.fit(x, y, batch_size=LOCAL_BATCH, epochs=1, verbose=0, shuffle=False)
        weights = hvd.allgather_object(_weights(model))
        _close(weights[0], weights[-1], 0)
        assert np.abs(weights[0][0] - before[0]).max() > 0
    finally:
        keras.mixed_precision.set_global_policy("float32")


@check
def learning_rate_warmup_ramps_from_lr_over_size_to_lr():
    tf, keras, hvd, r, n = _setup()
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(float(self.model.optimizer.learning_rate.numpy()))

    x, y = _data(n)
    model = _mlp(keras, 0)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)),
                  loss="mse", jit_compile=False)
    warmup = hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.4, warmup_epochs=2)
    hist = model.fit(_shard(x, r, n), _shard(y, r, n), batch_size=LOCAL_BATCH, epochs=3,
                     shuffle=False, verbose=0, callbacks=[warmup, Record()])
    expect = []
    for epoch in range(3):
        for b in range(STEPS):
            e = min(epoch + (b + 1) / STEPS, 2.0)
            expect.append(0.4 / n * (e * (n - 1) / 2 + 1))
    _close(seen, expect, 1e-6)
    _close(hist.history["learning_rate"], [expect[STEPS - 1], 0.4, 0.4], 1e-6)


@check
def learning_rate_schedule_scales_momentum_with_the_rate():
    tf, keras, hvd, r, n = _setup()
    slots = {}

    class Record(keras.callbacks.Callback):  # Keras builds the optimizer in the first step
        def _slots(self):
            return [v.numpy() for v in getattr(self.model.optimizer, "momentums", [])]

        def on_epoch_begin(self, epoch, logs=None):
            self._epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            slots[("begin", self._epoch, batch)] = self._slots()

        def on_train_batch_end(self, batch, logs=None):
            slots[("end", self._epoch, batch)] = self._slots()

    x, y = _data(n)
    model = _mlp(keras, 0)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)),
                  loss="mse", jit_compile=False)
    schedule = hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.1, multiplier=lambda e: 0.5 ** e,
                                                          start_epoch=1)
    hist = model.fit(_shard(x, r, n), _shard(y, r, n), batch_size=LOCAL_BATCH, epochs=3,
                     shuffle=False, verbose=0, callbacks=[schedule, Record()])
    _close(hist.history["learning_rate"], [0.1, 0.05, 0.025], 1e-7)
    assert np.abs(slots[("end", 0, STEPS - 1)][0]).max() > 0
    for epoch, ratio in ((1, 0.5), (2, 0.5)):
        before, after = slots[("end", epoch - 1, STEPS - 1)], slots[("begin", epoch, 0)]
        _close(after, [b * ratio for b in before], 1e-7)
    _close(slots[("begin", 1, 1)], slots[("end", 1, 0)], 0)  # staircase: once per epoch


@check
def load_model_restores_a_distributed_optimizer_with_its_state():
    tf, keras, hvd, r, n = _setup()
    from horovod_spark.keras.optimizer import _DistributedOptimizer

    x, y = _data(n)
    model = _mlp(keras, 0)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)),
                  loss="mse", jit_compile=False)
    model.fit(_shard(x, r, n), _shard(y, r, n), batch_size=LOCAL_BATCH, epochs=1, verbose=0,
              shuffle=False)
    path = hvd.broadcast_object(os.path.join(tempfile.mkdtemp(), "model.keras") if r == 0 else None)
    if r == 0:
        model.save(path)
    hvd.barrier()
    loaded = hvd.load_model(path)
    plain = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, _DistributedOptimizer)
    assert type(plain.optimizer) is keras.optimizers.SGD, type(plain.optimizer)
    assert int(loaded.optimizer.iterations) == STEPS
    _close(_weights(loaded), _weights(model), 0)
    _close([v.numpy() for v in loaded.optimizer.momentums],
           [v.numpy() for v in model.optimizer.momentums], 0)
    loaded.fit(_shard(x, r, n), _shard(y, r, n), batch_size=LOCAL_BATCH, epochs=1, verbose=0,
               shuffle=False)
    model.fit(_shard(x, r, n), _shard(y, r, n), batch_size=LOCAL_BATCH, epochs=1, verbose=0,
              shuffle=False)
    _close(_weights(loaded), _weights(model))


@check
def xla_compiled_training_is_refused_with_the_fix():
    tf, keras, hvd, r, n = _setup()
    model = _mlp(keras, 0)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse",
                  jit_compile=True)
    try:
        model.fit(np.ones((4, 5), np.float32), np.ones((4, 1), np.float32), verbose=0)
    except ValueError as exc:
        assert "jit_compile=False" in str(exc), exc
    else:
        raise AssertionError("training under XLA did not raise")


@check
def keras_value_functions_return_numpy():
    tf, keras, hvd, r, n = _setup()
    total = hvd.allreduce(float(r), op=hvd.Sum)
    assert isinstance(total, np.ndarray) and float(total) == n * (n - 1) / 2
    assert hvd.allgather(np.array([r])).tolist() == list(range(n))
    assert hvd.broadcast(np.array([r, r]), 1).tolist() == [1, 1]
    assert hvd.reducescatter(np.ones((n, 2), np.float32), op=hvd.Sum).tolist() == [[n, n]]


def run_all(names=None) -> dict:
    """Run the checks (all, or those named); {name: "ok" or the traceback}."""
    return run_named(CHECKS, names)
