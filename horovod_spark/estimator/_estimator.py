"""What TorchEstimator and KerasEstimator share: the driver side of ``fit``.

``_fit(df)``: check the params and the columns, prepare the used columns on the
JVM, dry-run the model on a few rows (``_dry_run``, per framework), then run the
barrier stage (``_launch.run_fit``) and wrap rank 0's result in the framework's
Model.  A framework subclass provides ``_required``, ``_user_objects``,
``_dry_run``, ``_train_fn`` and ``_model_class``.
"""
from __future__ import annotations

import cloudpickle

import dataclasses
import time
import uuid
from typing import Any, Callable, Dict, List, Optional, Sequence

from pyspark.ml import Estimator

from horovod_spark.estimator import _checks, _mlflow, _parquet
from horovod_spark.estimator import backend as _backend
from horovod_spark.estimator._decode import apply_decode
from horovod_spark.estimator._job import FitJob, TrainSpec
from horovod_spark.estimator.data import ColumnSpec, prepare
from horovod_spark.estimator.params import IGNORED, EstimatorParams, document_constructor

__all__ = ["DistributedEstimator"]


class DistributedEstimator(Estimator, EstimatorParams):
    """Base of TorchEstimator and KerasEstimator (not used directly)."""

    _required: Sequence[str] = ("model", "feature_cols", "label_cols")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        document_constructor(cls)

    def __init__(self, **kwargs: Any):
        super().__init__()
        self._init_params(kwargs)
        self._last_timings: Dict[str, float] = {}

    # framework hooks
    def _user_objects(self, values: Dict[str, Any], output_shapes: List[List[int]]) -> bytes:
        raise NotImplementedError

    def _dry_run(self, values: Dict[str, Any], sample: Dict[str, Any]) -> List[List[int]]:
        """The framework's dry run on the sample rows (decoded by decode_fn already)."""
        raise NotImplementedError

    def _model_input_shapes(self, values: Dict[str, Any]):
        """input_shapes the model itself declares, where the params give none (Keras)."""
        return None

    _train_fn: Callable[..., Any]
    _model_class: type
    _mlflow_flavor: str  # "pytorch" or "keras"

    def fit_on_parquet(self, path: str, params: Optional[dict] = None):
        """Fit on a Parquet data set (a file or a directory, any Spark-readable path).

        Each rank's task reads its share of the row groups itself with pyarrow where it
        can (see ``_parquet``), else Spark reads the files."""
        from pyspark.sql import SparkSession

        df = SparkSession.active().read.parquet(path)
        df._hvs_parquet_path = path  # the copy fit(df, params) makes keeps the DataFrame
        return self.fit(df, params)

    def _fit(self, dataset):
        began = time.perf_counter()
        values = self.param_values()
        if values.get("input_shapes") is None:
            values["input_shapes"] = self._model_input_shapes(values)
        values = _backend.with_input_shapes(values)
        _checks.require(type(self).__name__, values, [
            n for n in self._required if not (n == "loss" and values.get("loss_constructors"))])
        _checks.warn_ignored(self, IGNORED)
        specs = _checks.checked_specs(dataset, values)
        spark = dataset.sparkSession
        num_proc = _checks.resolve_num_proc(spark, _backend.num_proc(values))
        # vars(): a Connect DataFrame answers any unknown attribute with a Column
        parquet_path = vars(dataset).get("_hvs_parquet_path")
        direct = _parquet.plan(parquet_path, specs, num_proc) if parquet_path else None
        sample = _parquet.sample(direct, specs, _checks.SAMPLE_ROWS) if direct is not None \
            else None  # (the direct read needs no Spark job for it)
        if sample is None:
            sample = _checks.sample_batch(dataset, specs)
        sample = apply_decode(values["decode_fn"], sample, "the driver's sample rows")
        output_shapes = self._dry_run(values, sample)
        job = self._barrier_job(values, specs, output_shapes)
        job = dataclasses.replace(job, train=dataclasses.replace(job.train, num_proc=num_proc))
        prepared = prepare(dataset, specs)
        if direct is not None:  # the tasks read the files: the stage needs num_proc partitions
            job = dataclasses.replace(job, parquet=direct)
            prepared = spark.range(0, num_proc, 1, num_proc)
        probe = _write_probe(job.train.store, job.train.run_id)
        job = dataclasses.replace(job, train=dataclasses.replace(
            job.train, store_probe=probe, resume=bool(values["run_id"])))
        checked, stage_start = time.perf_counter(), time.time()
        try:
            result = self._run(spark, prepared, num_proc, job, values["verbose"])
        finally:
            if probe:
                job.train.store.remove(probe)
        done = time.perf_counter()
        result.setdefault("timings", {}).setdefault("stamps", {}).update(
            stage_start=stage_start, stage_end=time.time())
        self._last_timings = dict(result.get("timings", {}), check_seconds=checked - began,
                                  parquet_direct=direct is not None,
                                  stage_seconds=done - checked, fit_seconds=done - began)
        return self._fitted(values, result, output_shapes, job.train.run_id)

    def _fitted(self, values: Dict[str, Any], result: Dict[str, Any],
                output_shapes: List[List[int]], run_id: str):
        """The Model of rank 0's result; the history says which epoch it is (best_epoch)
        and where early stopping stopped (stopped_epoch); MLflow hears of it."""
        history = dict(result["history"])
        for key in ("best_epoch", "stopped_epoch"):
            if result.get(key) is not None:
                history[key] = [result[key]]
        decode = values.get("decode_fn")
        fitted = self._model_class(
            model_bytes=result["model"], history=history, output_shapes=output_shapes,
            decode_bytes=cloudpickle.dumps(decode) if decode is not None else None,
            feature_cols=values["feature_cols"], label_cols=values["label_cols"],
            run_id=run_id, input_shapes=values["input_shapes"],
            array_padding=values["array_padding"], sparse_vectors=values["sparse_vectors"])
        if _mlflow.wanted(values["mlflow"]):
            _mlflow.log_fit(values, fitted, history, self._mlflow_flavor, values["mlflow"])
        return fitted

    def _run(self, spark, prepared, num_proc: int, job: FitJob, verbose: int):
        from horovod_spark.estimator._launch import run_fit

        return run_fit(spark, prepared, num_proc, job, verbose)

    def _barrier_job(self, values: Dict[str, Any], specs: Sequence[ColumnSpec],
                     output_shapes: List[List[int]]) -> FitJob:
        from horovod_spark.estimator.store import LocalStore

        validation = values["validation"]
        store = values["store"] or LocalStore(_default_store_dir())
        train = TrainSpec(
            user=self._user_objects(values, output_shapes), feature_cols=tuple(values["feature_cols"]),
            label_cols=tuple(values["label_cols"]), weight_col=values["sample_weight_col"],
            batch_size=values["batch_size"], epochs=values["epochs"], shuffle=values["shuffle"],
            seed=values["random_seed"],
            backward_passes_per_step=values["backward_passes_per_step"],
            use_gpu=values["use_gpu"], verbose=values["verbose"], store=store,
            run_id=values["run_id"] or f"run-{uuid.uuid4().hex[:12]}",
            has_validation=bool(validation), specs=tuple(specs),
            val_batch_size=values["val_batch_size"] or 0,
            train_steps=values["train_steps_per_epoch"],
            val_steps=values["validation_steps_per_epoch"], tensorboard=values["tensorboard"],
            log_every_n_steps=values["log_every_n_steps"],
            early_stopping=values["early_stopping"],
            keep_best=_checks.keep_best(values["keep_best"], values["early_stopping"],
                                        bool(validation)))
        _checks.refuse_finished(store, train.run_id, train.epochs)
        store.check_writable(train.run_id)  # before any data moves or any epoch runs
        fraction = validation if isinstance(validation, float) else 0.0
        return FitJob(specs=tuple(specs), validation_fraction=fraction, train=train,
                          train_fn=type(self)._train_fn)


def _write_probe(store, run_id: str) -> str:
    """A file every rank must see before training (see _census.store_problem); "" where
    the Store cannot write one (a Store of the user's without write_bytes)."""
    probe = store.join("runs", run_id, f".shared-{uuid.uuid4().hex[:12]}")
    try:
        store.write_bytes(probe, b"written by the driver: every rank must see this file\n")
    except NotImplementedError:
        return ""
    return probe


def _default_store_dir() -> str:
    import os
    import tempfile

    return os.path.join(tempfile.gettempdir(), "horovod_spark_store")
