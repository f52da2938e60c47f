"""KerasEstimator and KerasModel: a Keras 3 model trained with Spark ML's API.

    est = KerasEstimator(num_proc=2, model=model, optimizer=keras.optimizers.Adam(1e-3),
                         loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                         feature_cols=["features"], label_cols=["label"], epochs=10)
    model = est.fit(df)              # a KerasModel
    model.transform(test_df)         # adds "label__output"

The model takes one input per feature column and returns one output per label
column (see ``_keras_io``).  It travels to the ranks as a ``.keras`` file (built
on the driver by the dry run); the optimizer as its Keras config (or a factory
called with no arguments); losses, metrics and callbacks by cloudpickle.  Give
``custom_objects`` for custom layers, as for ``keras.saving.load_model``.
"""
from __future__ import annotations

from typing import Any, Dict, List

from horovod_spark.estimator import _keras_io
from horovod_spark.estimator._estimator import DistributedEstimator
from horovod_spark.estimator.model import EstimatorModel
from horovod_spark.estimator.params import _declare, document_constructor

__all__ = ["KerasEstimator", "KerasModel"]


def _train_fn(spec, directory):
    """The rank body; imported there, so the driver need not import it at class creation."""
    from horovod_spark.estimator._train_keras import train

    return train(spec, directory)


class KerasModel(EstimatorModel):
    """A trained Keras model as a Spark ML Model; ``getModel()`` is the keras.Model."""

    _make_predictor = staticmethod(_keras_io.make_predictor)

    def getModel(self):
        """The trained keras.Model (a fresh copy, not compiled)."""
        if self._model_bytes is None:
            raise ValueError("KerasModel has no trained model")
        return _keras_io.loads_model(self._model_bytes)

    @classmethod
    def from_keras(cls, model: Any, custom_objects: Any = None, **params: Any) -> "KerasModel":
        """A KerasModel over an already trained (built) keras.Model."""
        return cls(model_bytes=_keras_io.dumps_model(model, custom_objects), **params)


class KerasEstimator(DistributedEstimator):
    """Trains a Keras model on the ranks of one barrier stage; ``fit`` returns a KerasModel."""

    _required = ("model", "optimizer", "loss", "feature_cols", "label_cols")
    _train_fn = staticmethod(_train_fn)
    _mlflow_flavor = "keras"
    _model_class = KerasModel

    def _model_input_shapes(self, values: Dict[str, Any]):
        """The model's own input shapes, as Horovod's KerasEstimator reshapes each feature
        column to them (784 pixels to (28, 28, 1)); None where no input has more than one
        axis a row, the model declares none, or one has an open size besides the batch."""
        try:
            shapes = [[-1] + [d for d in tuple(x.shape)[1:]] for x in values["model"].inputs]
        except (AttributeError, ValueError, TypeError):  # not built: no inputs yet
            return None
        flat = all(len(shape) <= 2 for shape in shapes)
        if len(shapes) != len(values.get("feature_cols") or ()) or flat or \
                any(d is None for shape in shapes for d in shape) or \
                values.get("sparse_vectors") == "sparse":
            return None  # (flat inputs need no reshape; sparse ones are refused by name later)
        return [[int(d) for d in shape] for shape in shapes]

    def _dry_run(self, values: Dict[str, Any], sample: Dict[str, Any]) -> List[List[int]]:
        _check_keras_objects(values)
        if values["transformation_fn"] is not None:
            sample = values["transformation_fn"](dict(sample))
        shapes, values["label_forms"] = _keras_io.dry_run(
            values["model"], values["loss"], values["feature_cols"], values["label_cols"],
            sample, values["sample_weight_col"])
        return shapes

    def _user_objects(self, values: Dict[str, Any], output_shapes: List[List[int]]) -> bytes:
        import cloudpickle
        import keras

        optimizer = values["optimizer"]
        if isinstance(optimizer, keras.optimizers.Optimizer):
            optimizer = keras.optimizers.serialize(optimizer)
        custom = values["custom_objects"] or {}
        return cloudpickle.dumps({
            "model": _keras_io.dumps_model(values["model"], custom), "optimizer": optimizer,
            "loss": values["loss"], "metrics": values["metrics"],
            "callbacks": values["callbacks"], "custom_objects": custom,
            "transformation_fn": values["transformation_fn"],
            "decode_fn": values["decode_fn"], "decode_workers": values["decode_workers"],
            "output_shapes": output_shapes, "label_forms": values.get("label_forms"),
            "loss_weights": values["loss_weights"],
            "gradient_compression": values["gradient_compression"],
            "checkpoint_callback": values["checkpoint_callback"]})


_declare(KerasEstimator, {
    "custom_objects": ("custom layers, losses and metrics by name, for loading the model on "
                       "the ranks and the executors", lambda v: v, None),
    "checkpoint_callback": ("Horovod's: a keras.callbacks.ModelCheckpoint run on rank 0 (at "
                            "its own filepath); with save_best_only, the fitted model is the "
                            "best epoch by its monitor, as keep_best", lambda v: v, None),
})
document_constructor(KerasEstimator)  # again: the signature lists its own params too


def _check_keras_objects(values: Dict[str, Any]) -> None:
    import keras

    if not isinstance(values["model"], keras.Model):
        raise TypeError(f"model must be a keras.Model, got {type(values['model']).__name__}")
    optimizer = values["optimizer"]
    if not isinstance(optimizer, (keras.optimizers.Optimizer, str)) and not callable(optimizer):
        raise TypeError(f"optimizer must be a Keras optimizer, its name, or a factory, "
                        f"got {type(optimizer).__name__}")
