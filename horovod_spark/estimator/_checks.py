"""Checks a fit runs on the driver before any rank starts.

What is checked where:

- here, from the params and the schema: a missing or misnamed column (the message
  lists the DataFrame's columns and the closest names), a column type training
  can't take, a validation column next to a fraction, num_proc;
- here, from a small sample of the prepared rows: an empty DataFrame;
- by the framework's dry run on that sample (``_torch_io.dry_run`` /
  ``_keras_io.dry_run``): the model can't take the features, a label whose shape
  does not match the model's output, a loss that can't compare them;
- by the barrier tasks, while they spill (``_spill.py``): NaN or null in any used
  column (the message names it), arrays of different lengths.  The tasks agree
  on it before any rank starts, so no training step runs on bad data.
"""
from __future__ import annotations

import difflib
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from horovod_spark._job import to_arrow
from horovod_spark.estimator.data import ColumnSpec, batch_from_table, column_specs, prepare

__all__ = ["checked_specs", "sample_batch", "resolve_num_proc", "require", "label_problem",
           "label_forms", "label_refused", "class_problem", "index_like", "INDEX", "VALUES",
           "warn_ignored", "keep_best", "refuse_finished"]

SAMPLE_ROWS = 16


def require(owner: str, values: Dict[str, Any], names: Sequence[str]) -> None:
    missing = [n for n in names if values.get(n) in (None, [], ())]
    if missing:
        raise ValueError(f"{owner} needs {', '.join(missing)}; pass "
                         + ", ".join(f"{n}=..." for n in missing))


def checked_specs(df, values: Dict[str, Any]) -> List[ColumnSpec]:
    """The column specs of a fit; ValueError / TypeError before anything runs."""
    validation = values.get("validation")
    val_col = validation if isinstance(validation, str) else None
    try:
        specs = column_specs(df.schema, values["feature_cols"], values["label_cols"],
                             values.get("sample_weight_col"), val_col, values.get("array_padding"),
                             values.get("sparse_vectors") == "sparse")
    except ValueError as exc:
        raise ValueError(_with_suggestions(str(exc), df.columns, _used(values, val_col))) \
            from None
    collated = [s.name for s in specs if s.pad and s.pad[0] == "collate"]
    if collated and values.get("decode_fn") is None:
        raise ValueError(f"array_padding gives column(s) {collated} the rule 'collate', which "
                         f"hands their rows to decode_fn; pass decode_fn=fn, where fn(batch) "
                         f"returns the batch with each as one array (padded or packed), or "
                         f"pad them instead (a length n, or 'longest')")
    return specs


def _used(values: Dict[str, Any], val_col: Optional[str]) -> List[str]:
    cols = list(values["feature_cols"]) + list(values["label_cols"])
    return cols + [c for c in (values.get("sample_weight_col"), val_col) if c]


def _with_suggestions(message: str, columns: Sequence[str], used: Sequence[str]) -> str:
    hints = []
    for name in used:
        if name in columns:
            continue
        close = difflib.get_close_matches(name, columns, n=1, cutoff=0.6) or \
            [c for c in columns if c.lower() == name.lower()]
        if close:
            hints.append(f"'{name}' -> '{close[0]}'?")
    return message + (f" (did you mean {', '.join(hints)})" if hints else "")


def sample_batch(df, specs: Sequence[ColumnSpec], rows: int = SAMPLE_ROWS):
    """A few prepared rows as numpy, for the dry run; ValueError when there are none."""
    table = to_arrow(prepare(df, specs).limit(rows))
    if table.num_rows == 0:
        raise ValueError("the DataFrame is empty: there are no rows to train on")
    return batch_from_table(table, specs)


def resolve_num_proc(spark, num_proc: Optional[int]) -> int:
    from horovod_spark._job import Cluster

    n = num_proc if num_proc is not None else Cluster(spark).default_parallelism()
    if n < 1:
        raise ValueError(f"num_proc must be at least 1, got {n}")
    return n


#: How a label column's batch reaches the loss, chosen on the driver by the dry run and used
#: alike on every rank: INDEX, class indices (int64), one per row or one per position of the
#: output's axes beside its class axis; VALUES, float32, in the output's shape where it has
#: as many values per row (one-hot rows, regression targets), else as the column holds it.
INDEX, VALUES = "index", "values"


def _integral(label: np.ndarray) -> bool:
    if label.dtype.kind in "iub":
        return True
    return label.dtype.kind == "f" and bool(np.all(np.isfinite(label))) and \
        bool(np.all(np.mod(label, 1) == 0))


def _class_axis(per_row: Sequence[int], class_axis: int) -> Optional[int]:
    """The index of the class axis in a per-row shape, or None where there is none."""
    if not per_row:
        return None
    axis = class_axis % len(per_row)
    return axis if per_row[axis] > 1 else None


def index_like(label: np.ndarray, out_shape: Sequence[int], class_axis: int) -> bool:
    """Whole numbers, one per row (or one per position beside the output's class axis, as
    per-pixel classes are), next to an output with several values on its class axis
    (``class_axis`` of the per-row shape: 0 for torch, -1 for Keras)."""
    per_row = [int(d) for d in out_shape[1:]]
    axis = _class_axis(per_row, class_axis)
    if axis is None or not _integral(label):
        return False
    return list(label.shape[1:]) == per_row[:axis] + per_row[axis + 1:]


def label_forms(label: np.ndarray, out_shape: Sequence[int], class_axis: int) -> List[str]:
    """The forms to try for a label next to an output of ``out_shape``, in order: integer
    class indices as indices first; whole-number floats (a libsvm or Spark ML label) as
    they are first, as Horovod hands them (a loss may convert them itself), then as
    indices; anything else as values."""
    if not index_like(label, out_shape, class_axis):
        return [VALUES]
    return [INDEX, VALUES] if label.dtype.kind in "iub" else [VALUES, INDEX]


def class_problem(name: str, label: np.ndarray, out_shape: Sequence[int],
                  class_axis: int) -> Optional[str]:
    """Why class indices in ``label`` can't index the output's classes, or None."""
    per_row = [int(d) for d in out_shape[1:]]
    axis = _class_axis(per_row, class_axis)
    if axis is None or not len(label):
        return None
    classes = per_row[axis]
    if label.min() < 0 or label.max() >= classes:
        return (f"label column '{name}' has class {int(label.max())} (or a negative one) "
                f"but the model outputs {classes} values per row")
    return None


def label_problem(name: str, label: np.ndarray, out_shape: Sequence[int]) -> Optional[str]:
    """Why ``label`` (rows first) has not as many values per row as an output of
    ``out_shape``, or None."""
    per_row = [int(d) for d in out_shape[1:]]
    if int(np.prod(label.shape[1:])) != int(np.prod(per_row)):
        return (f"label column '{name}' has shape {list(label.shape[1:])} per row but the "
                f"model's output for it has shape {per_row} per row")
    return None


def label_refused(name: str, label: np.ndarray, out_shape: Sequence[int], class_axis: int,
                  tried: List[tuple]) -> str:
    """The message for a label the loss took in no form; ``tried``: (form, what the loss was
    given, the error)."""
    lead = (class_problem(name, label, out_shape, class_axis)
            if index_like(label, out_shape, class_axis) else None) \
        or label_problem(name, label, out_shape) \
        or f"the loss can't take label column '{name}' next to the model's output"
    attempts = "; ".join(f"as {form} ({given}): {error}" for form, given, error in tried)
    return (f"{lead}, and the loss takes it in no form: {attempts}. Give one label value per "
            f"output value (one-hot rows, regression targets), or whole-number class indices "
            f"with a class loss (CrossEntropyLoss, NLLLoss, sparse_categorical_crossentropy)")


def warn_ignored(params, ignored: Dict[str, str]) -> None:
    """One warning naming every set parameter that has no job here, and what replaces it."""
    import warnings

    named = [f"{n} ({why})" for n, why in ignored.items() if params.isSet(n)]
    if named:
        warnings.warn(f"{type(params).__name__} ignores Horovod parameter(s) with no job "
                      f"here: "
                      + "; ".join(named), UserWarning, stacklevel=4)


def keep_best(value: Any, early_stopping: Any, has_validation: bool) -> Optional[tuple]:
    """keep_best as (metric, mode), or None."""
    from horovod_spark.estimator.trainer import default_monitor

    if value is None or value is False:
        return None
    if value is True:
        if early_stopping is not None:
            return (early_stopping.monitor, early_stopping.mode)
        return (default_monitor(has_validation), "auto")
    return tuple(value) if isinstance(value, tuple) else (value, "auto")


def refuse_finished(store, run_id: str, epochs: int) -> None:
    """A run whose checkpoints reach ``epochs`` would train nothing: say so."""
    done = store.checkpoint_epochs(run_id)
    if done and done[-1] + 1 >= epochs:
        raise ValueError(
            f"run {run_id!r} in {store} has already trained {done[-1] + 1} epoch(s) and "
            f"epochs={epochs}: fitting it again would train nothing. Give a new run_id to "
            f"train from scratch, or epochs > {done[-1] + 1} to train it further")

