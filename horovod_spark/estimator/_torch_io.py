"""How torch sees the data: one place for the conventions that training, the
driver's dry run and prediction must share.

- inputs: one float32 tensor per feature column, ``model(*inputs)``; a scalar
  column is ``(batch, 1)``, a vector or array column ``(batch, width)``;
- outputs: one per label column (a tuple when there are several);
- labels: each label column has a *form* (``_checks.INDEX`` or ``VALUES``), chosen by
  the driver's dry run as the first the loss takes (``_checks.label_forms``): class
  indices (``int64``, ``(batch,)`` or ``(batch, *positions)``: CrossEntropyLoss,
  NLLLoss), or float32 viewed in its output's shape when it has as many values (one-hot
  rows, regression), else as the column holds it (a loss that converts it itself);
- sample weights scale per-row losses: the loss is called with ``reduction='none'``
  (a copy of an ``nn.Module`` loss, or the keyword for a function) and the
  weighted mean is taken.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["to_inputs", "as_outputs", "shape_label", "batch_loss",
           "metric_fns", "fit_label", "label_tensor", "dumps_model", "loads_model", "make_predictor", "describe_inputs",
           "forward_in_eval", "dry_run"]


def _tensor(array: np.ndarray):
    import torch

    if not array.flags.writeable:  # views of the memory-mapped shard
        array = np.array(array)
    return torch.from_numpy(array)


def label_tensor(label: np.ndarray, device: Any = None):
    """A label column's batch as a tensor in its own dtype (``fit_label`` shapes it)."""
    t = _tensor(label)
    return t.to(device) if device is not None else t


def to_inputs(features: Sequence[np.ndarray], device: Any = None) -> list:
    """One tensor per feature column; a SparseRows (sparse_vectors="sparse") is a
    torch.sparse_coo_tensor."""
    out = []
    for f in features:
        t = f.torch() if hasattr(f, "torch") else _tensor(f.reshape(-1, 1) if f.ndim == 1 else f)
        out.append(t.to(device) if device is not None else t)
    return out


def as_outputs(output: Any) -> list:
    return list(output) if isinstance(output, (tuple, list)) else [output]


def _is_class_index(label, output) -> bool:
    import torch

    return label.dtype == torch.int64 and label.dim() == 1 and output.dim() == 2 \
        and output.shape[1] > 1


def shape_label(label: np.ndarray, output, device: Any = None, form: Optional[str] = None):
    """The label tensor in `form` (the module doc) next to ``output``."""
    return fit_label(label_tensor(label, device), output, form)


def fit_label(t, output, form: Optional[str] = None):
    """A label tensor in `form` next to ``output`` (see the module doc); no form: an int64
    label of one value per row next to several output values is indices, else values."""
    import torch

    if form is None:
        form = "index" if _is_class_index(t, output) else "values"
    if form == "index":
        return t if t.dtype == torch.int64 else t.long()
    if t.dtype != torch.float32:
        t = t.float()
    return t.view(output.shape) if t.numel() == output.numel() else t


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
               weights: Optional[Any] = None, loss_weights: Optional[Sequence[float]] = None):
    """The batch's loss: the sum over labels (each times its ``loss_weights`` entry),
    weighted per row when ``weights``."""
    if weights is None and len(outputs) == 1 and not loss_weights:  # no `0 +` node
        return loss_fns[0](outputs[0], labels[0])
    total = 0
    scales = loss_weights or [1.0] * len(outputs)
    for loss_fn, output, label, scale in zip(loss_fns, outputs, labels, scales):
        if weights is None:
            value = loss_fn(output, label)
        else:
            per_row = _per_row(loss_fn, output, label)
            value = (per_row * weights).sum() / weights.sum().clamp_min(1e-12)
        total = total + (value * scale if scale != 1.0 else value)
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


def forward_in_eval(model: Any, inputs: Sequence[Any]) -> list:
    """The model's outputs on `inputs` (a list), in eval mode and without gradients; the
    model is left in the mode it was in, whatever the forward raised."""
    import torch

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return as_outputs(model(*inputs))
    finally:
        model.train(was_training)


def dry_run(model: Any, loss_fns: Sequence[Callable], feature_cols: Sequence[str],
            label_cols: Sequence[str], sample: dict,
            weight_col: Optional[str] = None) -> Tuple[List[List[int]], List[str]]:
    """Run the model and the loss on a few rows; (the output shapes per row, each label
    column's form: the first the loss takes).

    Raises:
        ValueError: the model can't take the features, a label does not match its
            output, or the loss can't compare them; the message names the columns.
    """
    from horovod_spark.estimator.data import numeric

    features = [numeric(sample[c], c) for c in feature_cols]
    try:
        outputs = forward_in_eval(model, to_inputs(features))
    except Exception as exc:
        raise ValueError(f"the model can't take the feature columns "
                         f"{describe_inputs(feature_cols, features)} (one input each): "
                         f"{type(exc).__name__}: {exc}") from exc
    if len(outputs) != len(label_cols):
        raise ValueError(f"the model returns {len(outputs)} output(s) but there are "
                         f"{len(label_cols)} label columns {list(label_cols)}; return one "
                         f"output per label column")
    labels, forms = [], []
    for loss_fn, name, output in zip(loss_fns, label_cols, outputs):
        form, label = _chosen_form(model, loss_fn, name, sample[name], output)
        forms.append(form)
        labels.append(label)
    weights = _tensor(sample[weight_col]) if weight_col else None
    try:
        batch_loss(loss_fns, outputs, labels, weights)
    except Exception as exc:
        shapes = ", ".join(f"output {list(o.shape)} {o.dtype} vs label '{n}' "
                           f"{list(t.shape)} {t.dtype}"
                           for o, t, n in zip(outputs, labels, label_cols))
        raise ValueError(f"the loss can't compare the model's output with the label ({shapes}): "
                         f"{type(exc).__name__}: {exc}") from exc
    return [list(o.shape[1:]) for o in outputs], forms


def _chosen_form(model: Any, loss_fn: Callable, name: str, label: np.ndarray, output):
    """(the first form of `label` the loss takes next to `output`, the label in it); a
    ValueError saying what each form met where it takes none."""
    from horovod_spark.estimator import _checks

    import warnings

    shape, tried = tuple(output.shape), []
    for form in _checks.label_forms(label, shape, class_axis=0):
        t = shape_label(label, output, form=form)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's "target size" warning: the calls decide
            problem = loss_problem(model, loss_fn, name, label, output, t)
            error = None if problem else _loss_error(loss_fn, output, t)
        if problem:  # the loss runs but could not learn the label: no other form helps
            raise ValueError(problem)
        if error is None:
            return form, t
        tried.append((form, f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}", error))
    raise ValueError(_checks.label_refused(name, label, shape, 0, tried))


def _loss_error(loss_fn: Callable, output, label) -> Optional[str]:
    """Why the loss can't take `label` next to `output`, or None.  A loss that takes a label
    only by broadcasting it across the batch (a [16] label against [16, 16] outputs) is
    caught by a second call one row shorter, where the broadcast fails."""
    calls = [(output, label)]
    if len(output) > 2 and label.shape != output.shape:
        calls.append((output[:-1], label[:-1]))
    try:
        for out, lab in calls:
            value = loss_fn(out, lab)
            if not hasattr(value, "shape"):
                raise TypeError(f"the loss returned a {type(value).__name__}, not a tensor")
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        return f"{type(exc).__name__}: {first}"
    return None


_CLASS_LOSSES = ("CrossEntropyLoss", "NLLLoss", "cross_entropy", "nll_loss")


def _loss_name(loss_fn: Callable) -> str:
    return getattr(loss_fn, "__name__", type(loss_fn).__name__)


def loss_problem(model: Any, loss_fn: Callable, name: str, label: np.ndarray, output,
                 label_t) -> Optional[str]:
    """Why ``loss_fn`` can't learn ``label`` from ``output`` although their shapes agree,
    or None: a class loss next to one output value per row (softmax over one value: the
    loss is 0 whatever the model does), or any loss whose gradient is 0 on the sample."""
    import torch

    per_row = int(np.prod(output.shape[1:]))
    loss_name = _loss_name(loss_fn)
    if loss_name in _CLASS_LOSSES and per_row == 1:
        classes = int(label.max()) + 1 if label.dtype.kind in "iu" and len(label) else 2
        linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        example = f" (e.g. Linear({linear[-1].in_features}, {max(classes, 2)}))" if linear else ""
        kind = f"integer classes (up to {classes - 1} in the sample rows)" \
            if label.dtype.kind in "iu" else f"{label.dtype} values"
        return (f"{loss_name} for label column '{name}' needs one output value per class, "
                f"but the model outputs 1 value per row and the label holds {kind}: the loss "
                f"would be 0 whatever the model learns. Make the model's last layer output "
                f"one value per class{example}, or use a regression loss such as MSELoss "
                f"for a numeric label")
    probe = output.detach().float().requires_grad_(True) if output.is_floating_point() \
        else None
    if probe is None:
        return None
    try:
        with torch.enable_grad():
            value = loss_fn(probe.to(output.dtype), label_t)
            grad, = torch.autograd.grad(value, probe, allow_unused=True)
    except Exception:
        return None  # the full loss call below reports what fails
    if grad is not None and bool(torch.isfinite(value)) and not bool(grad.abs().sum() > 0):
        return (f"{loss_name} does not change with the model's output for label column "
                f"'{name}' (output {list(output.shape)} {output.dtype}, label "
                f"{list(label_t.shape)} {label_t.dtype}): its gradient is 0 on the sample "
                f"rows, so training would not move the model; check the loss against the "
                f"output's shape and the label's dtype")
    return None

