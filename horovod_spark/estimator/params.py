"""The estimators' Spark ML Params, each declared once with a doc and a converter.

Names are Horovod's (``num_proc``, ``feature_cols``, ...), so a Horovod estimator
ports by swapping the import.  Every param gets a camelCase getter and setter
(``getFeatureCols`` / ``setFeatureCols``) generated from the one declaration;
constructors take the same names as keywords and reject unknown ones.
"""
from __future__ import annotations

import inspect
import numbers
import textwrap
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

from pyspark.ml.param import Param, Params, TypeConverters

__all__ = ["EstimatorParams", "ModelParams", "document_constructor"]


def _identity(value: Any) -> Any:
    return value


def _to_validation(value: Any) -> Any:
    """A fraction in [0, 1) of the rows, or the name of a column that marks them."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"validation must be a fraction in [0, 1) or a column name, got {value!r}")
    if not 0.0 <= float(value) < 1.0:
        raise ValueError(f"validation fraction must be in [0, 1), got {value!r}")
    return float(value)


def _to_store(value: Any) -> Any:
    from horovod_spark.estimator.store import Store

    if value is None or isinstance(value, Store):
        return value
    if isinstance(value, str):
        return Store.create(value)
    raise TypeError(f"store must be a Store or a path, got {type(value).__name__}")


def _to_list(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def _to_optional_int(value: Any) -> Any:
    return None if value is None else TypeConverters.toInt(value)


def _to_positive_int(name: str) -> Callable[[Any], int]:
    def convert(value: Any) -> int:
        out = TypeConverters.toInt(value)
        if out < 1:
            raise ValueError(f"{name} must be at least 1, got {value!r}")
        return out

    return convert


def _to_optional_positive_int(name: str) -> Callable[[Any], Any]:
    positive = _to_positive_int(name)
    return lambda value: None if value is None else positive(value)


def _to_optional_floats(value: Any) -> Any:
    return None if value is None else TypeConverters.toListFloat(_to_list(value))


def _to_early_stopping(value: Any) -> Any:
    from horovod_spark.estimator.trainer import EarlyStopping

    return EarlyStopping.of(value)


def _to_keep_best(value: Any) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (list, tuple)) and len(value) == 2 and value[1] in ("min", "max"):
        return (str(value[0]), value[1])
    raise TypeError(f"keep_best must be True, a metric name or (name, 'min' | 'max'), "
                    f"got {value!r}")


def _callable_or_none(name: str) -> Callable[[Any], Any]:
    def convert(value: Any) -> Any:
        if value is not None and not callable(value):
            raise TypeError(f"{name} must be callable, got {type(value).__name__}")
        return value

    return convert


def _to_optional_nonnegative_int(value: Any):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"decode_workers must be None or an integer >= 0, got {value!r}")
    return value


def _to_padding(value: Any) -> Any:
    from horovod_spark.estimator.data import padding_rule

    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError(f"array_padding must be a dict of column name -> rule, got "
                        f"{type(value).__name__}")
    return {str(name): padding_rule(str(name), rule) for name, rule in value.items()}


def _to_sparse_vectors(value: Any) -> str:
    if value not in ("dense", "sparse"):
        raise ValueError(f"sparse_vectors must be 'dense' or 'sparse', got {value!r}")
    return value


def _to_backend(value: Any) -> Any:
    from horovod_spark.estimator.backend import to_backend

    return to_backend(value)


def _to_shapes(value: Any) -> Any:
    from horovod_spark.estimator.backend import to_shapes

    return to_shapes(value)


def _to_list_string(value: Any) -> Any:
    return None if value is None else TypeConverters.toListString(_to_list(value))


def _to_optional_string(value: Any) -> Any:
    return None if value is None else TypeConverters.toString(value)


# name: (doc, converter, default).  The one declaration of every param.
_TRAINING: Dict[str, Tuple[str, Callable[[Any], Any], Any]] = {
    "num_proc": ("number of ranks (barrier tasks); default: the default parallelism",
                 _to_optional_int, None),
    "model": ("the model to train (a torch.nn.Module or a Keras model)", _identity, None),
    "optimizer": ("the optimizer: an instance bound to the model's parameters, or a "
                  "factory called with the model's parameters (torch) / no arguments (Keras)",
                  _identity, None),
    "loss": ("loss function: callable(output, label), or one per label column",
             _identity, None),
    "metrics": ("metrics reported per epoch: callables(output, label) (torch) or Keras "
                "metrics; names come from __name__ or a dict's keys", _identity, None),
    "feature_cols": ("feature column names, one model input each", _to_list_string, None),
    "label_cols": ("label column names, one model output each", _to_list_string, None),
    "sample_weight_col": ("column of per-row loss weights", _to_optional_string, None),
    "validation": ("fraction in [0, 1) of the rows held out for validation, or the name of "
                   "a column that is true (non-zero) on validation rows", _to_validation, None),
    "batch_size": ("rows per batch on each rank", _to_positive_int("batch_size"), 32),
    "epochs": ("number of passes over the data set", _to_positive_int("epochs"), 1),
    "callbacks": ("KerasEstimator: Keras callbacks, run on every rank after the metrics are "
                  "averaged over ranks; TorchEstimator: callables(epoch, metrics) or objects "
                  "with on_epoch_end(epoch, metrics), run on rank 0", _to_list, None),
    "store": ("where checkpoints and the run's files go: a Store or a path "
              "(local, hdfs://, s3://, dbfs:/); default: a local temporary directory",
              _to_store, None),
    "run_id": ("name of the run under <store>/runs/; fitting again with the same run_id "
               "resumes from its last checkpoint; default: a fresh id per fit",
               _to_optional_string, None),
    "shuffle": ("shuffle the rows of every rank each epoch", TypeConverters.toBoolean, True),
    "transformation_fn": ("callable(batch: dict[str, numpy.ndarray]) -> dict applied to every "
                          "batch on the ranks before training and validation", _identity, None),
    "decode_fn": ("callable(batch: dict[str, numpy.ndarray]) -> dict, or (batch, rng) -> dict: "
                  "turns binary and string feature columns (numpy arrays of bytes / str) into "
                  "numbers; runs on the ranks in decode_workers threads ahead of training, "
                  "in validation, in the driver's checks and in Model.transform (rng: a numpy "
                  "Generator seeded per batch, for reproducible augmentation)",
                  _callable_or_none("decode_fn"), None),
    "decode_workers": ("threads that run decode_fn on each rank, ahead of the training step; "
                       "default: the rank's share of its host's cores (1-4); 0: on the "
                       "training thread", _to_optional_nonnegative_int, None),
    "array_padding": ("variable-length array columns, column name -> rule: n or (n, value) "
                      "pads every row with value (default 0) or cuts it to n values; "
                      "'longest' or ('longest', value) pads each batch to its longest row; "
                      "'collate' hands decode_fn the rows as an array of 1-D arrays to "
                      "collate itself.  In training and Model.transform", _to_padding, None),
    "sparse_vectors": ("how ml Vector feature columns reach the model: 'dense' (default), "
                       "float32 arrays densified on the JVM; 'sparse' (TorchEstimator), kept "
                       "sparse through the shard, each batch a torch.sparse_coo_tensor "
                       "(decode_fn and transformation_fn see a SparseRows: CSR arrays, "
                       "toarray())", _to_sparse_vectors, "dense"),
    "use_gpu": ("train on the rank's GPU when it has one", TypeConverters.toBoolean, True),
    "backward_passes_per_step": ("batches whose gradients are accumulated locally before "
                                 "one allreduce and optimizer step",
                                 _to_positive_int("backward_passes_per_step"), 1),
    "verbose": ("0: quiet; 1: one line per epoch on rank 0; 2: and per-rank data sizes",
                TypeConverters.toInt, 1),
    "random_seed": ("seed of the shuffles and of the validation split", TypeConverters.toInt, 0),
    "val_batch_size": ("rows per validation batch on each rank; default: batch_size",
                       _to_optional_positive_int("val_batch_size"), None),
    "train_steps_per_epoch": ("batches every rank trains per epoch; default: the global rows "
                              "over the global batch, rounded up (an epoch may then pass over "
                              "the data more or less than once)",
                              _to_optional_positive_int("train_steps_per_epoch"), None),
    "validation_steps_per_epoch": ("at most this many validation batches per rank and epoch; "
                                   "default: all the rank's validation rows",
                                   _to_optional_positive_int("validation_steps_per_epoch"), None),
    "gradient_compression": ("hvd.Compression.fp16 (or .none): how gradients travel in the "
                             "allreduce", _identity, None),
    "loss_weights": ("one weight per label column's loss; the loss is their weighted sum "
                     "(default: every weight 1)", _to_optional_floats, None),
    "early_stopping": ("stop when a metric stops improving: an EarlyStopping(monitor, patience, "
                       "min_delta, mode) or a dict of those; every rank takes the same "
                       "decision", _to_early_stopping, None),
    "keep_best": ("the fitted model is the epoch with the best value of a metric, not the "
                  "last: True (early_stopping's monitor, else val_loss with validation, else "
                  "loss), a metric name, or (name, 'min' | 'max'); the history says which "
                  "epoch (best_epoch)", _to_keep_best, None),
    "tensorboard": ("write TensorBoard event files on rank 0 under <store>/runs/<run_id>/logs: "
                    "None (default) when tensorboardX is installed, True (fail without it), "
                    "False", lambda v: None if v is None else TypeConverters.toBoolean(v), None),
    "log_every_n_steps": ("TensorBoard: the training loss and learning rate every this many "
                          "steps (0: per epoch only)", TypeConverters.toInt, 50),
    "backend": ("Horovod's: an object with num_processes() (a SparkBackend) that sets the "
                "number of ranks, in place of num_proc", _to_backend, None),
    "input_shapes": ("one shape per feature column: each batch's column is reshaped to it "
                     "before the model, in training and in Model.transform; -1 takes the "
                     "batch size ([-1, 1, 28, 28]), a shape without -1 is one row's",
                     _to_shapes, None),
    "mlflow": ("log the fit to MLflow from the driver (params, per-epoch metrics, the model): "
               "None (default) when mlflow is installed and a run is active, True (start a run "
               "if none is active), False", lambda v: None if v is None else
               TypeConverters.toBoolean(v), None),
}

# Horovod's params that have no job here: accepted, and named in one warning per fit with
# what replaces them.
IGNORED: Dict[str, str] = {
    "train_reader_num_workers": "each rank memory-maps its own spilled Arrow shard",
    "val_reader_num_workers": "each rank memory-maps its own spilled Arrow shard",
    "reader_pool_type": "each rank memory-maps its own spilled Arrow shard",
    "inmemory_cache_all": "the memory-mapped shard is in the page cache after the first epoch",
    "shuffle_buffer_size": "shuffle (windows of the rank's shard, reshuffled every epoch)",
    "partitions_per_process": "the DataFrame is split into num_proc partitions, one per rank",
    "compress_sparse_cols": "sparse vectors are densified on the JVM, nothing is written out",
    "transformation_edit_fields": "transformation_fn may add, change and drop batch keys",
    "transformation_removed_fields": "transformation_fn may add, change and drop batch keys",
    "label_shapes": "a label takes its model output's shape when it has as many values",
    "mp_start_method": "each rank is its own process already",
    "data_module": "the estimator reads its data itself (fit or fit_on_parquet)",
    "loader_num_epochs": "epochs (the stream of batches never ends within a fit)",
}
_TRAINING.update({name: (f"Horovod's, accepted and ignored: {why}", _identity, None)
                  for name, why in IGNORED.items()})

# Params a fitted Model carries (they are JSON and persist with the model).
_MODEL: Dict[str, Tuple[str, Callable[[Any], Any], Any]] = {
    "feature_cols": _TRAINING["feature_cols"],
    "label_cols": _TRAINING["label_cols"],
    "output_cols": ("prediction column names, one per label; default <label>__output",
                    _to_list_string, None),
    "batch_size": ("rows per prediction batch", _to_positive_int("batch_size"), 1024),
    "run_id": ("the run this model came from", _to_optional_string, None),
    "input_shapes": _TRAINING["input_shapes"],
    "array_padding": _TRAINING["array_padding"],
    "sparse_vectors": _TRAINING["sparse_vectors"],
}


def _camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.split("_"))


def _declare(cls: type, table: Dict[str, Tuple[str, Callable[[Any], Any], Any]]) -> type:
    """Attach one Param plus getX/setX per table entry to ``cls``."""
    for name, (doc, converter, _) in table.items():
        setattr(cls, name, Param(Params._dummy(), name, doc, typeConverter=converter))
        camel = _camel(name)

        def getter(self: Params, _name: str = name) -> Any:
            return self.getOrDefault(_name)

        def setter(self: Params, value: Any, _name: str = name) -> Params:
            return self._set(**{_name: value})

        getter.__doc__ = f"Gets {name}: {doc}."
        setter.__doc__ = f"Sets {name}: {doc}."
        setattr(cls, "get" + camel, getter)
        setattr(cls, "set" + camel, setter)
    cls._param_table = {**getattr(cls, "_param_table", {}), **table}
    return cls


class _TableParams(Params):
    _param_table: Dict[str, Tuple[str, Callable[[Any], Any], Any]] = {}

    def _init_params(self, kwargs: Dict[str, Any]) -> None:
        unknown = sorted(set(kwargs) - set(self._param_table))
        if unknown:
            raise TypeError(
                f"{type(self).__name__} got unknown parameter(s) {unknown}; "
                f"it takes {sorted(self._param_table)}")
        self._setDefault(**{k: d for k, (_, _, d) in self._param_table.items()})
        self._set(**kwargs)

    def param_values(self, names: Optional[Iterable[str]] = None) -> Dict[str, Any]:
        """Every param's value (or default) by name."""
        names = self._param_table if names is None else names
        return {name: self.getOrDefault(name) for name in names}


class EstimatorParams(_TableParams):
    """Params shared by TorchEstimator and KerasEstimator."""


class ModelParams(_TableParams):
    """Params of a fitted TorchModel / KerasModel."""


_declare(EstimatorParams, _TRAINING)
_declare(ModelParams, _MODEL)


def document_constructor(cls: type) -> type:
    """Give ``cls`` the signature and the Args section of its param table.

    The constructor takes ``**kwargs`` (checked against the table), so without this
    ``help()``, an IDE and the API reference would show no parameter at all.
    """
    table = cls._param_table
    cls.__signature__ = inspect.Signature([
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
        for name, (_, _, default) in table.items()])
    required = set(getattr(cls, "_required", ()))
    args = [textwrap.fill(f"{name}: {doc[:1].upper()}{doc[1:]}." + _default(name in required, doc,
                                                                           default),
                          width=88, initial_indent="    ", subsequent_indent="        ")
            for name, (doc, _, default) in table.items()]
    # a second call (after a framework declares its own params) replaces the Args section
    head = inspect.cleandoc(cls.__doc__ or "").split("\n\nArgs:\n")[0]
    cls.__doc__ = head + "\n\nArgs:\n" + "\n".join(args) + "\n"
    return cls


def _default(required: bool, doc: str, default: Any) -> str:
    if required:
        return " Required."
    return "" if "default:" in doc else f" Default: {default!r}."
