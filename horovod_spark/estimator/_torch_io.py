"""How torch sees the data: one place for the conventions that training, the
driver's dry run and prediction must share.

- inputs: one float32 tensor per feature column, ``model(*inputs)``; a scalar
  column is ``(batch, 1)``, a vector or array column ``(batch, width)``;
- outputs: one per label column (a tuple when there are several);
- labels: an integer scalar label next to an output of several values per row is
  a class index (``int64``, ``(batch,)``: CrossEntropyLoss); any other label is
  float32, viewed in its output's shape when it has as many values;
- sample weights scale per-row losses: the loss is called with ``reduction='none'``
  (a copy of an ``nn.Module`` loss, or the keyword for a function) and the
  weighted mean is taken.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["to_inputs", "as_outputs", "shape_label", "label_problem", "batch_loss",
           "metric_fns", "dumps_model", "loads_model", "make_predictor", "describe_inputs",
           "dry_run"]


def _tensor(array: np.ndarray):
    import torch

    if not array.flags.writeable:  # views of the memory-mapped shard
        array = np.array(array)
    return torch.from_numpy(array)


def to_inputs(features: Sequence[np.ndarray], device: Any = None) -> list:
    out = []
    for f in features:
        t = _tensor(f.reshape(-1, 1) if f.ndim == 1 else f)
        out.append(t.to(device) if device is not None else t)
    return out


def as_outputs(output: Any) -> list:
    return list(output) if isinstance(output, (tuple, list)) else [output]


def _is_class_index(label, output) -> bool:
    import torch

    return label.dtype == torch.int64 and label.dim() == 1 and output.dim() == 2 \
        and output.shape[1] > 1


def shape_label(label: np.ndarray, output, device: Any = None):
    """The label tensor in the form the loss takes next to ``output``."""
    import torch

    t = _tensor(label)
    if device is not None:
        t = t.to(device)
    if _is_class_index(t, output):
        return t
    if t.dtype != torch.float32:
        t = t.float()
    return t.view(output.shape) if t.numel() == output.numel() else t


def label_problem(name: str, label: np.ndarray, output) -> Optional[str]:
    """Why ``label`` can't be compared with ``output``, or None (see ``_checks``)."""
    from horovod_spark.estimator._checks import label_problem as problem

    return problem(name, label, tuple(output.shape))


def _per_row(loss_fn: Callable, output, label):
    import torch

    if isinstance(loss_fn, torch.nn.Module) and hasattr(loss_fn, "reduction"):
        unreduced = copy.copy(loss_fn)
        unreduced.reduction = "none"
        values = unreduced(output, label)
    else:
        values = loss_fn(output, label, reduction="none")
    return values.reshape(values.shape[0], -1).mean(dim=1) if values.dim() > 1 else values


def batch_loss(loss_fns: Sequence[Callable], outputs: list, labels: list,
               weights: Optional[Any] = None):
    """The batch's loss: the sum over labels, weighted per row when ``weights``."""
    if weights is None and len(outputs) == 1:  # no `0 +` node in the graph
        return loss_fns[0](outputs[0], labels[0])
    total = 0
    for loss_fn, output, label in zip(loss_fns, outputs, labels):
        if weights is None:
            total = total + loss_fn(output, label)
        else:
            per_row = _per_row(loss_fn, output, label)
            total = total + (per_row * weights).sum() / weights.sum().clamp_min(1e-12)
    return total


def metric_fns(metrics: Any) -> List[Tuple[str, Callable]]:
    """(name, fn(output, label)) pairs from a list of callables or a dict."""
    if not metrics:
        return []
    if isinstance(metrics, dict):
        return list(metrics.items())
    return [(getattr(m, "__name__", type(m).__name__), m) for m in metrics]


def dumps_model(model: Any) -> bytes:
    import cloudpickle

    return cloudpickle.dumps(model)


def loads_model(data: bytes) -> Any:
    import cloudpickle

    return cloudpickle.loads(data)


def make_predictor(model_bytes: bytes) -> Callable[[List[np.ndarray]], List[np.ndarray]]:
    """features -> outputs as numpy, for ``Model.transform`` on the executors."""
    import torch

    model = loads_model(model_bytes)
    model.eval()

    def predict(features: List[np.ndarray]) -> List[np.ndarray]:
        with torch.no_grad():
            outs = as_outputs(model(*to_inputs(features)))
        return [o.detach().cpu().numpy() for o in outs]

    return predict


def describe_inputs(names: Sequence[str], features: Sequence[np.ndarray]) -> str:
    return ", ".join(f"'{n}' {f.dtype}{list(f.shape)}" for n, f in zip(names, features))


def dry_run(model: Any, loss_fns: Sequence[Callable], feature_cols: Sequence[str],
            label_cols: Sequence[str], sample: dict,
            weight_col: Optional[str] = None) -> List[List[int]]:
    """Run the model and the loss on a few rows; the output shapes per row.

    Raises:
        ValueError: the model can't take the features, a label does not match its
            output, or the loss can't compare them; the message names the columns.
    """
    import torch

    features = [sample[c] for c in feature_cols]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            outputs = as_outputs(model(*to_inputs(features)))
    except Exception as exc:
        raise ValueError(f"the model can't take the feature columns "
                         f"{describe_inputs(feature_cols, features)} (one input each): "
                         f"{type(exc).__name__}: {exc}") from exc
    finally:
        model.train(was_training)
    if len(outputs) != len(label_cols):
        raise ValueError(f"the model returns {len(outputs)} output(s) but there are "
                         f"{len(label_cols)} label columns {list(label_cols)}; return one "
                         f"output per label column")
    labels = []
    for name, output in zip(label_cols, outputs):
        problem = label_problem(name, sample[name], output)
        if problem:
            raise ValueError(problem)
        labels.append(shape_label(sample[name], output))
    weights = _tensor(sample[weight_col]) if weight_col else None
    try:
        batch_loss(loss_fns, outputs, labels, weights)
    except Exception as exc:
        shapes = ", ".join(f"output {list(o.shape)} {o.dtype} vs label '{n}' "
                           f"{list(t.shape)} {t.dtype}"
                           for o, t, n in zip(outputs, labels, label_cols))
        raise ValueError(f"the loss can't compare the model's output with the label ({shapes}): "
                         f"{type(exc).__name__}: {exc}") from exc
    return [list(o.shape[1:]) for o in outputs]
