"""TorchEstimator and TorchModel: a torch.nn.Module trained with Spark ML's API.

    est = TorchEstimator(num_proc=2, model=net, optimizer=torch.optim.Adam(net.parameters()),
                         loss=torch.nn.CrossEntropyLoss(), feature_cols=["features"],
                         label_cols=["label"], batch_size=64, epochs=10, store="/shared/runs")
    model = est.fit(df)              # a TorchModel
    model.transform(test_df)         # adds "label__output"

The model takes one float32 tensor per feature column (``model(*inputs)``) and
returns one output per label column; see ``_torch_io`` for the shapes.  The
model, the optimizer (an instance bound to the model's parameters, or a factory
``params -> optimizer``), the loss, the metrics, ``transformation_fn`` and the
callbacks (``on_epoch_end(epoch, metrics)`` or callables, run on rank 0) are
cloudpickled together, so the optimizer stays bound to the model on the ranks.
"""
from __future__ import annotations

from typing import Any, Dict, List

from horovod_spark.estimator import _torch_io, _train_torch
from horovod_spark.estimator._estimator import DistributedEstimator
from horovod_spark.estimator.model import EstimatorModel
from horovod_spark.estimator.params import (_callable_or_none, _declare, _to_list,
                                            document_constructor)


def _interval(value: Any) -> str:
    if value not in ("epoch", "step"):
        raise ValueError(f"lr_scheduler_interval must be 'epoch' or 'step', got {value!r}")
    return value

__all__ = ["TorchEstimator", "TorchModel"]


class TorchModel(EstimatorModel):
    """A trained torch model as a Spark ML Model; ``getModel()`` is the nn.Module."""

    _make_predictor = staticmethod(_torch_io.make_predictor)

    def getModel(self):
        """The trained torch.nn.Module (a fresh copy, on the CPU)."""
        if self._model_bytes is None:
            raise ValueError("TorchModel has no trained model")
        return _torch_io.loads_model(self._model_bytes)

    @classmethod
    def from_module(cls, module: Any, **params: Any) -> "TorchModel":
        """A TorchModel over an already trained module (for transform and save)."""
        return cls(model_bytes=_torch_io.dumps_model(module), **params)


class TorchEstimator(DistributedEstimator):
    """Trains a torch model on the ranks of one barrier stage; ``fit`` returns a TorchModel."""

    _required = ("model", "optimizer", "loss", "feature_cols", "label_cols")
    _train_fn = staticmethod(_train_torch.train)
    _mlflow_flavor = "pytorch"
    _model_class = TorchModel

    def _user_objects(self, values: Dict[str, Any], output_shapes: List[List[int]]) -> bytes:
        _check_torch_objects(values)
        return _torch_io.dumps_model({name: values.get(name) for name in _USER})

    def _dry_run(self, values: Dict[str, Any], sample: Dict[str, Any]) -> List[List[int]]:
        _check_torch_objects(values)
        labels = values["label_cols"]
        loss = [make() for make in values["loss_constructors"]] \
            if values["loss_constructors"] else values["loss"]
        losses = list(loss) if isinstance(loss, (list, tuple)) else [loss] * len(labels)
        if len(losses) != len(labels):
            raise ValueError(f"{len(losses)} losses for {len(labels)} label columns {labels}; "
                             f"give one loss, or one per label column")
        if values["transformation_fn"] is not None:
            sample = values["transformation_fn"](dict(sample))
        shapes, values["label_forms"] = _torch_io.dry_run(
            values["model"], losses, values["feature_cols"], labels, sample,
            values["sample_weight_col"])
        return shapes


_declare(TorchEstimator, {
    "lr_scheduler": ("a learning-rate schedule: a factory called with the optimizer on every "
                     "rank, returning a torch.optim.lr_scheduler object (ReduceLROnPlateau "
                     "steps on val_loss, else loss)", _callable_or_none("lr_scheduler"), None),
    "lr_scheduler_interval": ("when the schedule steps: 'epoch' (after each epoch) or 'step' "
                              "(after each optimizer step)", _interval, "epoch"),
    "train_minibatch_fn": ("Horovod's custom training step: fn(model, optimizer, "
                           "transform_outputs, loss_fn, inputs, labels, sample_weights) -> "
                           "(outputs, loss); its optimizer.step() averages the gradients over "
                           "the ranks", _callable_or_none("train_minibatch_fn"), None),
    "val_minibatch_fn": ("the custom validation step: fn(model, transform_outputs, loss_fn, "
                         "inputs, labels, sample_weights) -> (outputs, loss), run without "
                         "gradients", _callable_or_none("val_minibatch_fn"), None),
    "loss_constructors": ("Horovod's: functions called with no arguments on each rank that "
                          "return the losses (in place of loss)", _to_list, None),
})
document_constructor(TorchEstimator)  # again: the signature lists its own params too

# what travels to the ranks, cloudpickled together (label_forms: the dry run's choice)
_USER = ("model", "optimizer", "loss", "metrics", "transformation_fn", "decode_fn",
         "label_forms",
         "decode_workers", "callbacks",
         "loss_constructors", "loss_weights", "gradient_compression", "lr_scheduler",
         "lr_scheduler_interval", "train_minibatch_fn", "val_minibatch_fn")


def _check_torch_objects(values: Dict[str, Any]) -> None:
    import torch

    model, optimizer = values["model"], values["optimizer"]
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(optimizer, torch.optim.Optimizer):
        own = {id(p) for p in model.parameters()}
        bound = [p for g in optimizer.param_groups for p in g["params"]]
        if not bound or any(id(p) not in own for p in bound):
            raise ValueError("the optimizer is not bound to the model's parameters; build it "
                             "from model.parameters(), or pass a factory "
                             "(lambda params: torch.optim.SGD(params, lr=0.1))")
    elif not callable(optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or a factory, "
                        f"got {type(optimizer).__name__}")
