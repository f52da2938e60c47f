"""Horovod's ``backend`` and ``input_shapes`` estimator params.

``backend``: Horovod's estimators take a backend object that runs the job; the
one thing ours asks of it is how many ranks to run (``num_processes()``), so a
Horovod ``SparkBackend`` or this module's ``SparkBackend`` both serve.  As in
Horovod, at most one of ``backend`` and ``num_proc`` may be given.

``input_shapes``: one shape per feature column; each batch's column is reshaped
to it before the model sees it, in training, validation and ``Model.transform``.
A shape is the whole batch's, as Horovod's (``[-1, 1, 28, 28]``: -1 takes the
batch size); a shape without -1 whose size is one row's (``[1, 28, 28]``) is
taken per row.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

__all__ = ["SparkBackend"]


class SparkBackend:
    """A backend that says how many ranks an estimator runs (Horovod's ``SparkBackend``).

    Args:
        num_proc: ranks (barrier tasks); default: the session's default parallelism.
        env, stdout, stderr, verbose, nics, prefix_output_with_timestamp, start_timeout:
            Horovod's, accepted: rank output already reaches the driver with a rank
            prefix, and the rank environment comes from the Spark task.
    """

    def __init__(self, num_proc: Optional[int] = None, env: Optional[dict] = None,
                 stdout=None, stderr=None, prefix_output_with_timestamp: bool = False,
                 start_timeout: Optional[int] = None, verbose: int = 1, nics=None,
                 **kwargs: Any) -> None:
        if num_proc is not None and int(num_proc) < 1:
            raise ValueError(f"SparkBackend: num_proc must be at least 1, got {num_proc!r}")
        self._num_proc = None if num_proc is None else int(num_proc)

    def num_processes(self) -> Optional[int]:
        """Ranks to run; None: the session's default parallelism."""
        return self._num_proc

    def __repr__(self) -> str:
        return f"SparkBackend(num_proc={self._num_proc})"


def to_backend(value: Any) -> Any:
    """The param's converter: anything with num_processes()."""
    if value is not None and not callable(getattr(value, "num_processes", None)):
        raise TypeError(f"backend must have num_processes() (Horovod's SparkBackend or "
                        f"horovod_spark.estimator.SparkBackend), got {type(value).__name__}")
    return value


def to_shapes(value: Any) -> Optional[List[List[int]]]:
    """The param's converter: a list of shapes (lists of ints, at most one -1)."""
    if value is None:
        return None
    shapes = [[int(d) for d in shape] for shape in value]
    for shape in shapes:
        if shape.count(-1) > 1 or any(d < -1 or d == 0 for d in shape):
            raise ValueError(f"input_shapes: {shape} is not a shape (positive sizes, at most "
                             f"one -1 for the batch)")
    return shapes


def num_proc(values: Dict[str, Any]) -> Optional[int]:
    """The ranks a fit asks for, from num_proc or the backend (None: the default)."""
    backend = values.get("backend")
    if backend is None:
        return values.get("num_proc")
    if values.get("num_proc") is not None:
        raise ValueError('At most one of parameters "backend" and "num_proc" may be specified')
    n = backend.num_processes()
    return None if n is None else int(n)


def reshape(a: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """One batch of a column in its input shape (see the module's doc)."""
    a = np.asarray(a)
    per_row = int(np.prod(a.shape[1:], dtype=np.int64)) if a.ndim else 1
    if -1 not in shape and int(np.prod(shape, dtype=np.int64)) == per_row:
        return a.reshape((a.shape[0], *shape))
    return a.reshape(shape)


class Reshaped:
    """transformation_fn, then every feature column in its input shape (picklable)."""

    def __init__(self, transformation_fn: Optional[Callable], feature_cols: Sequence[str],
                 input_shapes: Sequence[Sequence[int]]) -> None:
        self.transformation_fn = transformation_fn
        self.shapes = dict(zip(feature_cols, input_shapes))

    def __call__(self, batch: dict) -> dict:
        if self.transformation_fn is not None:
            batch = self.transformation_fn(batch)
        batch = dict(batch)
        for col, shape in self.shapes.items():
            batch[col] = reshape(batch[col], shape)
        return batch


def with_input_shapes(values: Dict[str, Any]) -> Dict[str, Any]:
    """A fit's param values whose transformation_fn also reshapes the inputs."""
    shapes = values.get("input_shapes")
    if not shapes:
        return values
    cols = values.get("feature_cols") or []
    if len(shapes) != len(cols):
        raise ValueError(f"input_shapes has {len(shapes)} shape(s) for {len(cols)} feature "
                         f"column(s) {cols}; give one shape per feature column")
    return dict(values, transformation_fn=Reshaped(values.get("transformation_fn"), cols, shapes))


def reshaping_predictor(make_predictor: Callable, shapes: Sequence[Sequence[int]],
                        model_bytes: bytes) -> Callable:
    """make_predictor(model_bytes) whose inputs are reshaped first (functools.partial it)."""
    predict = make_predictor(model_bytes)
    return lambda arrays: predict([reshape(a, s) for a, s in zip(arrays, shapes)])
