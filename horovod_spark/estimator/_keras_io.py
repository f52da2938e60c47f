"""How Keras sees the data: the conventions training, the driver's dry run and
prediction share (the torch ones, ``_torch_io``, in Keras's argument order).

- inputs: one float32 array per feature column, a scalar column ``(batch, 1)``;
  a single feature column is passed as one array, several as a list;
- outputs: one per label column; labels: each in the *form* the driver's dry run
  chose, the first the loss takes (``_checks.label_forms``, the class axis last):
  class indices (``sparse_*`` losses), or float32 in its output's shape when it has as
  many values (one-hot rows, regression), else as the column holds it;
- the model travels as the bytes of a ``.keras`` file (weights and architecture,
  no pickled code) next to the user's ``custom_objects``.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from horovod_spark.estimator import _checks

__all__ = ["to_inputs", "shape_label", "dumps_model", "loads_model", "make_predictor",
           "dry_run", "as_outputs"]


def to_inputs(features: Sequence[np.ndarray]) -> Any:
    if any(hasattr(f, "torch") for f in features):
        raise TypeError("KerasEstimator takes ml Vector columns dense: leave sparse_vectors "
                        "at 'dense' (sparse_vectors='sparse' is TorchEstimator's)")
    arrays = [np.asarray(f.reshape(-1, 1) if f.ndim == 1 else f, dtype=np.float32)
              for f in features]
    return arrays[0] if len(arrays) == 1 else arrays


def as_outputs(output: Any) -> List[np.ndarray]:
    outs = list(output) if isinstance(output, (list, tuple)) else [output]
    return [np.asarray(o) for o in outs]


def shape_label(label: np.ndarray, out_shape: Sequence[int],
                form: Optional[str] = None) -> np.ndarray:
    """`label` in `form` next to an output of `out_shape` (see the module doc); no form: an
    integer label of one value per row next to several output values is indices."""
    if form is None:
        form = _checks.INDEX if label.dtype.kind in "iu" and \
            _checks.index_like(label, out_shape, -1) else _checks.VALUES
    if form == _checks.INDEX:
        return label if label.dtype.kind in "iu" else label.astype(np.int64)
    label = label.astype(np.float32, copy=False)
    rows = len(label)
    per_row = tuple(out_shape[1:])
    return label.reshape((rows,) + per_row) if label.size == rows * int(np.prod(per_row)) \
        else label


def dumps_model(model: Any, custom_objects: Optional[Dict[str, Any]] = None) -> bytes:
    """cloudpickle of {"keras": the .keras file's bytes, "custom_objects": ...}."""
    import cloudpickle

    with tempfile.TemporaryDirectory(prefix="hvs-keras-") as tmp:
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        with open(path, "rb") as f:
            data = f.read()
    return cloudpickle.dumps({"keras": data, "custom_objects": custom_objects or {}})


def loads_model(blob: bytes, compile: bool = False) -> Any:
    import cloudpickle
    import keras

    parts = cloudpickle.loads(blob)
    with tempfile.TemporaryDirectory(prefix="hvs-keras-") as tmp:
        path = os.path.join(tmp, "model.keras")
        with open(path, "wb") as f:
            f.write(parts["keras"])
        return keras.saving.load_model(path, custom_objects=parts["custom_objects"] or None,
                                       compile=compile)


def make_predictor(model_bytes: bytes) -> Callable[[List[np.ndarray]], List[np.ndarray]]:
    """features -> outputs as numpy, for ``Model.transform`` on the executors."""
    model = loads_model(model_bytes)

    def predict(features: List[np.ndarray]) -> List[np.ndarray]:
        return as_outputs(model.predict_on_batch(to_inputs(features)))

    return predict


def dry_run(model: Any, loss: Any, feature_cols: Sequence[str], label_cols: Sequence[str],
            sample: dict, weight_col: Optional[str] = None) -> Tuple[List[List[int]], List[str]]:
    """Run the model (which builds it) and the loss on a few rows; (the output shapes, each
    label column's form).

    Raises:
        ValueError: naming the columns, as ``_torch_io.dry_run`` does.
    """
    import keras

    from horovod_spark.estimator.data import numeric

    features = [numeric(sample[c], c) for c in feature_cols]
    try:
        outputs = as_outputs(model(to_inputs(features), training=False))
    except Exception as exc:
        desc = ", ".join(f"'{n}' {f.dtype}{list(f.shape)}" for n, f in zip(feature_cols, features))
        raise ValueError(f"the model can't take the feature columns {desc} (one input each): "
                         f"{type(exc).__name__}: {exc}") from exc
    if len(outputs) != len(label_cols):
        raise ValueError(f"the model returns {len(outputs)} output(s) but there are "
                         f"{len(label_cols)} label columns {list(label_cols)}; return one "
                         f"output per label column")
    losses = list(loss) if isinstance(loss, (list, tuple)) else [loss] * len(label_cols)
    forms = [_chosen_form(keras.losses.get(fn), name, sample[name], output)
             for name, output, fn in zip(label_cols, outputs, losses)]
    return [list(o.shape[1:]) for o in outputs], forms


def _chosen_form(loss_fn: Callable, name: str, label: np.ndarray, output) -> str:
    """The first form of `label` the loss takes next to `output`; a ValueError saying what
    each form met where it takes none.  A loss that takes a label only by broadcasting it
    across the batch is caught by a second call one row shorter."""
    shape, tried = tuple(output.shape), []
    for form in _checks.label_forms(label, shape, class_axis=-1):
        y = shape_label(label, shape, form)
        calls = [(y, output)] + ([(y[:-1], output[:-1])]
                                 if len(y) > 2 and y.shape != tuple(shape) else [])
        try:
            for y_true, y_pred in calls:
                loss_fn(y_true, y_pred)
            return form
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [""])[0]
            tried.append((form, f"{y.dtype}{list(y.shape)}", f"{type(exc).__name__}: {first}"))
    raise ValueError(_checks.label_refused(name, label, shape, -1, tried))
