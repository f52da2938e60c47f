"""LightningEstimator: a LightningModule trained with Spark ML's API.

    class Net(L.LightningModule):
        def forward(self, x): ...                       # what transform predicts with
        def training_step(self, batch, batch_idx):      # batch: {column name: tensor}
            return F.cross_entropy(self(batch["features"]), batch["label"])
        def validation_step(self, batch, batch_idx): ...
        def configure_optimizers(self): return torch.optim.Adam(self.parameters())

    est = LightningEstimator(num_proc=2, model=Net(), feature_cols=["features"],
                             label_cols=["label"], batch_size=64, epochs=5,
                             validation=0.1, store="/shared/runs")
    model = est.fit(df)                 # a TorchModel: model.transform(df) adds label__output

Horovod's ``horovod.spark.lightning.TorchEstimator`` under its own name (it is also
``horovod_spark.spark.lightning.TorchEstimator``).  Each rank runs a real Lightning
``Trainer`` (``_train_lightning``) on the estimator's data path: the module's steps,
``configure_optimizers`` (schedules included), its hooks and ``self.log`` work as under
any Trainer; ``callbacks`` are Lightning callbacks; ``trainer_args`` go to the Trainer
(gradient clipping, precision, ``limit_*_batches``...), except those the estimator's own
params set.  The batch is a dict: each feature column as TorchEstimator's model input
(float32, ``(rows, width)``), label, weight and other numeric columns as tensors of
their own dtype, binary and string columns as numpy arrays (decode them in
``decode_fn``).  Checkpoints, resuming a ``run_id``, early stopping, ``keep_best``,
TensorBoard and MLflow are the estimator's, as for TorchEstimator.
"""
from __future__ import annotations

from typing import Any, Dict, List

from horovod_spark.estimator import _torch_io, _train_lightning
from horovod_spark.estimator._estimator import DistributedEstimator
from horovod_spark.estimator.params import _declare, document_constructor
from horovod_spark.estimator.torch_estimator import TorchModel

__all__ = ["LightningEstimator", "TorchEstimator", "TorchModel"]

# TorchEstimator's params a LightningModule says for itself
_MODULE_SAYS = {
    "optimizer": "configure_optimizers", "loss": "training_step",
    "loss_constructors": "training_step", "loss_weights": "training_step",
    "metrics": "self.log in its steps", "train_minibatch_fn": "training_step",
    "val_minibatch_fn": "validation_step", "lr_scheduler": "configure_optimizers",
    "gradient_compression": "the DDP strategy in trainer_args",
}


def _trainer_args(value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError(f"trainer_args must be a dict of Lightning Trainer arguments, "
                        f"got {type(value).__name__}")
    for key in value:
        if key in _train_lightning.OWN_TRAINER_ARGS:
            raise ValueError(f"trainer_args[{key!r}]: the estimator sets it from "
                             f"{_train_lightning.OWN_TRAINER_ARGS[key]}; drop it from "
                             f"trainer_args")
    return dict(value)


class LightningEstimator(DistributedEstimator):
    """Trains a LightningModule on the ranks of one barrier stage; ``fit`` returns a
    TorchModel over the trained module."""

    _required = ("model", "feature_cols", "label_cols")
    _train_fn = staticmethod(_train_lightning.train)
    _mlflow_flavor = "pytorch"
    _model_class = TorchModel

    def _user_objects(self, values: Dict[str, Any], output_shapes: List[List[int]]) -> bytes:
        _check_lightning(values)
        return _torch_io.dumps_model({
            "model": values["model"], "trainer_args": values["trainer_args"],
            "callbacks": values["callbacks"], "transformation_fn": values["transformation_fn"],
            "decode_fn": values["decode_fn"], "decode_workers": values["decode_workers"]})

    def _dry_run(self, values: Dict[str, Any], sample: Dict[str, Any]) -> List[List[int]]:
        """The module's forward on the sample's features: one output per label column, as
        transform will predict."""
        _check_lightning(values)
        model, labels = values["model"], values["label_cols"]
        if values["transformation_fn"] is not None:
            sample = values["transformation_fn"](dict(sample))
        batch = _train_lightning.as_batch(values["feature_cols"], sample)
        inputs = [batch[c] for c in values["feature_cols"]]
        try:
            outputs = _torch_io.forward_in_eval(model, inputs)
        except NotImplementedError as exc:
            raise ValueError(f"{type(model).__name__} has no forward(): define "
                             f"forward(*features), one input per feature column "
                             f"{values['feature_cols']}, so the fitted model can predict"
                             ) from exc
        if len(outputs) != len(labels):
            raise ValueError(f"{type(model).__name__}.forward returns {len(outputs)} outputs "
                             f"for {len(labels)} label columns {labels}; transform writes "
                             f"one prediction column per label column")
        return [list(o.shape[1:]) for o in outputs]


_declare(LightningEstimator, {
    "trainer_args": ("Lightning Trainer arguments (gradient_clip_val, precision, "
                     "limit_train_batches, a strategy...); not those the estimator's params "
                     "set: max_epochs (epochs), devices and num_nodes (num_proc), "
                     "accumulate_grad_batches (backward_passes_per_step)", _trainer_args, None),
})
document_constructor(LightningEstimator)

#: Horovod's name (horovod.spark.lightning.TorchEstimator)
TorchEstimator = LightningEstimator


def _check_lightning(values: Dict[str, Any]) -> None:
    try:
        import lightning.pytorch as pl
    except ImportError as exc:
        raise ImportError("LightningEstimator needs Lightning: pip install "
                          "'horovod-spark[lightning]'") from exc
    model = values["model"]
    if not isinstance(model, pl.LightningModule):
        raise TypeError(f"model must be a lightning.pytorch.LightningModule, got "
                        f"{type(model).__name__}; for a torch.nn.Module use TorchEstimator")
    for name, where in _MODULE_SAYS.items():
        if values.get(name) not in (None, [], {}):
            raise ValueError(f"{name}= is for TorchEstimator: a LightningModule gives it in "
                             f"{where}; drop {name}=")
    for cb in values.get("callbacks") or []:
        if not isinstance(cb, pl.Callback):
            raise TypeError(f"callbacks of LightningEstimator are lightning.pytorch.Callback "
                            f"objects, got {type(cb).__name__}")
