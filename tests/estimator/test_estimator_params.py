"""Params: declared once, with docs, converters, getters and setters; copies for tuning."""
import pytest
import torch

from horovod_spark.estimator import LocalStore, TorchEstimator, TorchModel
from horovod_spark.estimator.params import _TRAINING


def test_every_param_has_a_doc_a_getter_and_a_setter():
    est = TorchEstimator()
    for name in _TRAINING:
        param = est.getParam(name)
        assert param.doc and len(param.doc) > 10
        camel = "".join(p.capitalize() for p in name.split("_"))
        assert hasattr(est, "get" + camel) and hasattr(est, "set" + camel)


def test_defaults_and_setters_round_trip():
    est = TorchEstimator(feature_cols="x", label_cols=["y"])
    assert (est.getBatchSize(), est.getEpochs(), est.getShuffle(), est.getNumProc()) == \
        (32, 1, True, None)
    assert est.getFeatureCols() == ["x"]  # a single name becomes a list
    assert est.setEpochs(3).getEpochs() == 3


def test_converters_turn_paths_into_stores_and_check_ranges(tmp_path):
    est = TorchEstimator(store=str(tmp_path), validation=0.2)
    assert isinstance(est.getStore(), LocalStore)
    assert est.getValidation() == 0.2
    assert TorchEstimator(validation="is_val").getValidation() == "is_val"
    with pytest.raises(ValueError, match="batch_size must be at least 1"):
        TorchEstimator(batch_size=0)
    with pytest.raises(TypeError, match="store must be a Store or a path"):
        TorchEstimator(store=3)


def test_a_copy_with_extra_params_keeps_the_model_and_changes_only_those():
    net = torch.nn.Linear(2, 1)
    est = TorchEstimator(model=net, epochs=2)
    copy = est.copy({est.epochs: 5})
    assert copy.getEpochs() == 5 and est.getEpochs() == 2
    assert copy.getModel() is net


def test_the_keras_estimator_adds_custom_objects_and_the_torch_one_does_not():
    pytest.importorskip("keras")
    from horovod_spark.estimator import KerasEstimator

    assert KerasEstimator(custom_objects={"A": int}).getCustomObjects() == {"A": int}
    assert not TorchEstimator().hasParam("custom_objects")


def test_model_output_cols_default_to_the_label_names():
    model = TorchModel(feature_cols=["f"], label_cols=["a", "b"])
    assert model.getOutputCols() == ["a__output", "b__output"]
    assert model.setOutputCols(["p", "q"]).getOutputCols() == ["p", "q"]


@pytest.mark.parametrize("name", ["TorchEstimator", "KerasEstimator"])
def test_the_constructor_shows_every_param_with_its_default_and_doc(name):
    import inspect
    import pydoc

    import horovod_spark.estimator as estimator

    cls = getattr(estimator, name)
    signature = inspect.signature(cls)
    assert {p: v.default for p, v in signature.parameters.items()} == \
        {p: default for p, (_, _, default) in cls._param_table.items()}
    assert set(_TRAINING) < set(signature.parameters)  # and the framework's own params
    assert cls.__doc__.count("Args:") == 1
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in signature.parameters.values())
    text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    assert "batch_size=32" in text and "Rows per batch on each rank. Default: 32." in text
    assert "model: The model to train (a torch.nn.Module or a Keras model). Required." in text
    with pytest.raises(TypeError, match=r"got unknown parameter\(s\) \['batchsize'\]"):
        cls(batchsize=3)
