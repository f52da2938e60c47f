"""The rank side of KerasEstimator.fit: runs in each rank process.

One fit, on every rank: ``hvd.init()`` (while the task still spills the rank's
partition); the census of every shard (``_census.agree``): row counts, or the
problem every rank returns instead of training; map the rank's shard; load the model from
its ``.keras`` bytes; compile it with ``hvd.DistributedOptimizer`` around the
user's optimizer; build the optimizer on every rank (so that
``BroadcastGlobalVariablesCallback`` sends model and optimizer state in one
round when training begins); rank 0 restores the run's newest checkpoint (weights,
optimizer variables, epoch, history) if there is one, and every rank starts
from the epoch after it.  ``model.fit`` pulls ``RankData.steps`` batches per
epoch from one generator, the same count on every rank.  At each epoch's end,
in this order: ``MetricAverageCallback`` (training metrics: equal steps, so the
mean over ranks is the global mean), the validation rows (each rank evaluates
its own, and the results are weighted by row counts in one allreduce), the
user's callbacks (on every rank, so EarlyStopping stops every rank alike), and
rank 0's checkpoint.  Rank 0 returns the model's bytes, the history and its
timings; the other ranks return None.
"""
from __future__ import annotations

import io
import json
import time
from typing import Any, Dict, Iterator, List, Optional

import keras
import numpy as np

from horovod_spark.estimator import _keras_callbacks as kcb
from horovod_spark.estimator import _keras_io as kio
from horovod_spark.estimator._events import EventLog
from horovod_spark.estimator._job import Progress, RankData, TrainSpec, append_history, fit_on_rank
from horovod_spark.estimator.data import keeps_lists, numeric

__all__ = ["train"]


def train(spec: TrainSpec, directory: str) -> Optional[Dict[str, Any]]:
    import horovod_spark.keras as hvd

    return fit_on_rank(hvd, spec, directory, lambda s, data, entered: _fit(hvd, s, data, entered))


def _batches(spec: TrainSpec, data: RankData, user: dict, epochs: range,
             out_shapes: List[tuple]) -> Iterator[tuple]:
    transform = user.get("transformation_fn")
    for epoch in epochs:
        for batch in data.epoch(epoch):
            yield _keras_batch(spec, batch, transform, out_shapes)


def _loose(spec: TrainSpec, batches: Iterator[tuple]) -> Any:
    """`batches` for Keras.  Keras fixes every dimension its generator's first two batches
    agree on, so columns of variable-length rows (array_padding 'longest' or 'collate') go
    as a tf.data Dataset whose signature leaves their widths open; the rest as they are."""
    import itertools

    loose = {s.name for s in spec.specs if keeps_lists(s)}
    if not loose:
        return batches
    import tensorflow as tf

    batches = iter(batches)
    first = next(batches)

    def signature(arrays, cols):
        def one(a, col):
            a = np.asarray(a)
            return tf.TensorSpec((None,) + tuple(None if col in loose else d
                                                 for d in a.shape[1:]), tf.as_dtype(a.dtype))
        if isinstance(arrays, (list, tuple)):
            return tuple(one(a, c) for a, c in zip(arrays, cols))
        return one(arrays, cols[0])

    sig = (signature(first[0], spec.feature_cols), signature(first[1], spec.label_cols)) + \
        ((tf.TensorSpec((None,), tf.float32),) if len(first) == 3 else ())
    stream = (tuple(tuple(p) if isinstance(p, list) else p for p in b)
              for b in itertools.chain([first], batches))
    return tf.data.Dataset.from_generator(lambda: stream, output_signature=sig)


def _keras_batch(spec: TrainSpec, batch: dict, transform, out_shapes: List[tuple]) -> tuple:
    if transform is not None:
        batch = transform(dict(batch))
    x = kio.to_inputs([numeric(batch[c], c) for c in spec.feature_cols])
    ys = [kio.shape_label(batch[c], s, form)
          for c, (s, form) in zip(spec.label_cols, out_shapes)]
    y = ys[0] if len(ys) == 1 else ys
    if spec.weight_col:
        return x, y, np.asarray(batch[spec.weight_col], np.float32)
    return x, y


def _optimizer(user: dict):
    import keras

    opt = user["optimizer"]
    if isinstance(opt, dict):
        return keras.optimizers.deserialize(opt, custom_objects=user["custom_objects"] or None)
    if isinstance(opt, str):
        return keras.optimizers.get(opt)
    return opt()  # a factory


def _fit(hvd, spec: TrainSpec, data: RankData, entered: float) -> Optional[Dict[str, Any]]:
    import cloudpickle

    user = cloudpickle.loads(spec.user)
    data.decoding(user.get("decode_fn"), user.get("decode_workers"), hvd.local_size())
    model = kio.loads_model(user["model"])
    compression = {"compression": user["gradient_compression"]} \
        if user.get("gradient_compression") is not None else {}
    opt = hvd.DistributedOptimizer(_optimizer(user),
                                   backward_passes_per_step=spec.backward_passes_per_step,
                                   average_aggregated_gradients=True, **compression)
    model.compile(optimizer=opt, loss=user["loss"], metrics=user["metrics"] or None,
                  loss_weights=user.get("loss_weights"), jit_compile=False)
    opt.build(model.trainable_variables)
    rank = hvd.rank()
    start, history = _resume(hvd, spec, model, opt, rank)
    progress = Progress(spec, rank, data.steps, entered)
    forms = user.get("label_forms") or [None] * len(user["output_shapes"])
    out_shapes = [(tuple([None] + list(s)), form) for s, form in zip(user["output_shapes"], forms)]
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvd.callbacks.MetricAverageCallback()]
    if spec.has_validation:
        callbacks.append(_Validation(hvd, spec, data, user, out_shapes))
    checkpoint = user.get("checkpoint_callback")
    callbacks += _with_progress(kcb.placed(user.get("callbacks") or [], checkpoint, rank),
                                spec.batch_size)
    callbacks.append(_EpochEnd(spec, history, progress, rank))
    trainer = kcb.Trainer(hvd, spec, history, _keep_best(spec, checkpoint))
    callbacks.append(trainer)
    callbacks.append(kcb.Events(EventLog(spec.store, spec.run_id, rank, spec.tensorboard,
                                         spec.log_every_n_steps),
                                data.steps, spec.batch_size, hvd.size()))
    if start < spec.epochs:
        model.fit(_loose(spec, _batches(spec, data, user, range(start, spec.epochs), out_shapes)),
                  steps_per_epoch=data.steps, epochs=spec.epochs, initial_epoch=start,
                  verbose=0, shuffle=False, callbacks=callbacks)
    if rank != 0:
        return None
    trainer.restore_best()
    model_bytes = kio.dumps_model(model, user["custom_objects"])
    spec.store.write_bytes(spec.store.model_path(spec.run_id), model_bytes)
    return {"model": model_bytes, "history": history, "best_epoch": trainer.best_epoch,
            "stopped_epoch": trainer.stopped, "timings": progress.timings(spec.data_seconds)}


def _keep_best(spec: TrainSpec, checkpoint: Any):
    """keep_best, or Horovod's meaning of a checkpoint_callback that saves the best only:
    the fitted model is the epoch it saved last."""
    if spec.keep_best is None and getattr(checkpoint, "save_best_only", False):
        return (checkpoint.monitor, getattr(checkpoint, "mode", "auto"))
    return spec.keep_best


def _with_progress(callbacks: list, batch_size: int) -> list:
    """The user's callbacks, plus the progress display's unless they brought it."""
    from horovod_spark import progress

    if any(type(cb).__qualname__.endswith("KerasProgress") for cb in callbacks):
        return callbacks
    return callbacks + [progress.keras_callback(batch_size)]


class _Validation(keras.callbacks.Callback):
    """Each rank evaluates its validation rows; one allreduce weights them by row count."""

    def __init__(self, hvd, spec: TrainSpec, data: RankData, user: dict, out_shapes):
        super().__init__()
        self.hvd, self.spec, self.data, self.user, self.out_shapes = hvd, spec, data, user, \
            out_shapes

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        batches = [_keras_batch(self.spec, b, self.user.get("transformation_fn"),
                                self.out_shapes)
                   for b in self.data.validation()]
        rows = float(sum(len(b[1] if not isinstance(b[1], list) else b[1][0]) for b in batches))
        names = sorted(k for k in logs if np.ndim(logs[k]) == 0)
        values = np.zeros(len(names))
        if batches:
            result = self.model.evaluate(_loose(self.spec, _repeat(batches)), steps=len(batches),
                                         verbose=0,
                                         return_dict=True)
            values = np.array([float(result.get(n, np.nan)) for n in names]) * rows
        total = np.asarray(self.hvd.allreduce(np.append(values, rows), op=self.hvd.Sum,
                                              name=f"estimator.val.{epoch}"), np.float64)
        for name, value in zip(names, total[:-1]):
            if total[-1] and not np.isnan(value):  # a metric evaluate() does not report
                logs[f"val_{name}"] = float(value / total[-1])


def _repeat(batches: List[tuple]) -> Iterator[tuple]:
    while True:
        yield from batches


class _EpochEnd(keras.callbacks.Callback):
    """Last at each epoch's end: the history, the progress line, rank 0's checkpoint."""

    def __init__(self, spec: TrainSpec, history: Dict[str, List[float]], progress: Progress,
                 rank: int):
        super().__init__()
        self.spec, self.history, self.progress, self.rank = spec, history, progress, rank
        self.began = time.perf_counter()

    def on_epoch_begin(self, epoch, logs=None):
        self.began = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        metrics = {k: float(v) for k, v in (logs or {}).items() if np.ndim(v) == 0}
        append_history(self.history, metrics)
        self.progress.epoch_done(epoch, metrics, time.perf_counter() - self.began)
        if self.rank == 0:
            _save_checkpoint(self.spec, self.model, epoch, self.history)


def _save_checkpoint(spec: TrainSpec, model, epoch: int, history: Dict[str, List[float]]):
    """weights and optimizer variables (npz, no pickles) + epoch and history (json)."""
    arrays = {f"w{i}": w for i, w in enumerate(model.get_weights())}
    arrays.update({f"o{i}": np.asarray(v) for i, v in enumerate(model.optimizer.variables)})
    meta = json.dumps({"epoch": epoch, "history": history}).encode()
    buf = io.BytesIO()
    np.savez(buf, meta=np.frombuffer(meta, np.uint8), **arrays)
    spec.store.save_checkpoint(spec.run_id, epoch, buf.getvalue(), history)


def _resume(hvd, spec: TrainSpec, model, opt, rank: int):
    """(first epoch to run, history so far); rank 0 restores the newest checkpoint."""
    state = (0, {})
    if rank == 0:
        found = spec.store.latest_checkpoint(spec.run_id)
        if found is not None:
            epoch, blob = found
            with np.load(io.BytesIO(blob), allow_pickle=False) as z:
                meta = json.loads(z["meta"].tobytes())
                weights = [z[f"w{i}"] for i in range(sum(k.startswith("w") for k in z.files))]
                opt_vars = [z[f"o{i}"] for i in range(sum(k.startswith("o") for k in z.files))]
            try:
                model.set_weights(weights)
                if len(opt_vars) != len(opt.variables):
                    raise ValueError(f"{len(opt_vars)} optimizer variables saved, "
                                     f"{len(opt.variables)} now")
                for var, value in zip(opt.variables, opt_vars):
                    var.assign(value)
            except ValueError as exc:
                raise ValueError(
                    f"cannot resume run {spec.run_id!r} from "
                    f"{spec.store.checkpoint_path(spec.run_id, epoch)}: the checkpoint does "
                    f"not fit this model and optimizer ({exc}); use a new run_id") from exc
            state = (meta["epoch"] + 1, meta["history"])
            if spec.verbose:
                print(f"resuming run {spec.run_id!r} after epoch {epoch + 1}", flush=True)
    return hvd.broadcast_object(state, root_rank=0)
