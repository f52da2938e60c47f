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


def is_class_index(label: np.ndarray, out_shape: Sequence[int]) -> bool:
    """An integer label, one per row, next to an output of one axis of several values."""
    return label.dtype.kind in "iu" and label.ndim == 1 and len(out_shape) == 2 and \
        int(out_shape[1]) > 1


def label_problem(name: str, label: np.ndarray, out_shape: Sequence[int]) -> Optional[str]:
    """Why ``label`` (rows first) can't be compared with an output of ``out_shape``, or None.

    An integer label of one value per row next to an output of one axis of several
    values is a class index; any other label must have as many values per row.
    """
    per_row = [int(d) for d in out_shape[1:]]
    if is_class_index(label, out_shape):
        classes = per_row[0]
        if len(label) and (label.min() < 0 or label.max() >= classes):
            return (f"label column '{name}' has class {int(label.max())} (or a negative one) "
                    f"but the model outputs {classes} values per row")
        return None
    if int(np.prod(label.shape[1:])) != int(np.prod(per_row)):
        return (f"label column '{name}' has shape {list(label.shape[1:])} per row but the "
                f"model's output for it has shape {per_row} per row")
    return None


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

