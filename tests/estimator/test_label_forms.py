"""Every label layout a loss takes passes the estimators' dry run, and the form it chose is the
one training uses; a label no form of which the loss takes is refused saying what each met.

The dry runs are the real ones (`_torch_io.dry_run`, `_keras_io.dry_run`) on a real model and
loss, on a sample as the driver draws it (16 rows): no Spark needed to decide a label's form.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from horovod_spark.estimator import _torch_io

ROWS = 16
rng = np.random.default_rng(0)
X = rng.normal(size=(ROWS, 4)).astype(np.float32)
CLASSES = np.arange(ROWS) % 3  # every class in the sample


def torch_dry_run(net, loss, label):
    return _torch_io.dry_run(net, [loss], ["x"], ["y"], {"x": X, "y": label})


def log_softmax_net(classes=3):
    return torch.nn.Sequential(torch.nn.Linear(4, classes), torch.nn.LogSoftmax(dim=1))


@pytest.mark.parametrize("label,loss,form", [
    # class indices as Spark ML and libsvm hold them (doubles), against NLLLoss itself
    (CLASSES.astype(np.float64), torch.nn.NLLLoss(), "index"),
    # ... and against Horovod's own example's loss, which converts them itself
    (CLASSES.astype(np.float64), lambda out, y: torch.nn.NLLLoss()(out, y.long()), "values"),
    (CLASSES.astype(np.int64), torch.nn.NLLLoss(), "index"),
    (CLASSES.astype(np.int32), torch.nn.CrossEntropyLoss(), "index"),
    (CLASSES.astype(np.float32), torch.nn.CrossEntropyLoss(), "index"),
    # one-hot rows (a OneHotEncoder's vectors): class probabilities
    (np.eye(3)[CLASSES], torch.nn.CrossEntropyLoss(), "values"),
    (np.eye(3)[CLASSES], torch.nn.BCEWithLogitsLoss(), "values"),
    # regression targets, three per row
    (rng.normal(size=(ROWS, 3)), torch.nn.MSELoss(), "values"),
])
def test_torch_takes_every_layout_its_loss_takes(label, loss, form):
    net = log_softmax_net() if "NLL" in repr(loss) or callable(loss) and \
        not isinstance(loss, torch.nn.Module) else torch.nn.Linear(4, 3)
    shapes, forms = torch_dry_run(net, loss, label)
    assert shapes == [[3]] and forms == [form]
    out = net(torch.from_numpy(X))
    y = _torch_io.fit_label(torch.from_numpy(label), out, form)  # what a rank hands the loss
    assert torch.isfinite(loss(out, y))


def test_torch_takes_per_pixel_class_indices_beside_the_class_axis():
    net = torch.nn.Sequential(torch.nn.Linear(4, 3 * 2 * 5), torch.nn.Unflatten(1, (3, 2, 5)))
    label = (np.arange(ROWS * 10).reshape(ROWS, 2, 5) % 3).astype(np.float64)
    assert torch_dry_run(net, torch.nn.CrossEntropyLoss(), label) == ([[3, 2, 5]], ["index"])


def test_a_regression_target_of_one_value_per_row_is_values():
    assert torch_dry_run(torch.nn.Linear(4, 1), torch.nn.MSELoss(),
                         rng.normal(size=ROWS)) == ([[1]], ["values"])


def test_torch_refuses_fractional_labels_for_a_class_loss_saying_what_each_form_met():
    with pytest.raises(ValueError) as err:
        torch_dry_run(log_softmax_net(), torch.nn.NLLLoss(), rng.normal(size=ROWS))
    text = str(err.value)
    assert text.startswith("label column 'y' has shape [] per row but the model's output for "
                           "it has shape [3] per row, and the loss takes it in no form: as "
                           "values (float32[16]): RuntimeError")
    assert "class indices with a class loss" in text


def test_torch_refuses_a_label_the_loss_takes_only_by_broadcasting_it_across_the_batch():
    # 16 outputs a row and 16 rows: MSELoss would broadcast the [16] label over each row
    with pytest.raises(ValueError, match=r"has shape \[\] per row but the model's output for "
                                         r"it has shape \[16\] per row, and the loss takes it "
                                         r"in no form"):
        torch_dry_run(torch.nn.Linear(4, ROWS), torch.nn.MSELoss(), rng.normal(size=ROWS))


def test_torch_names_a_class_beyond_the_outputs():
    with pytest.raises(ValueError, match=r"label column 'y' has class 2 \(or a negative one\) "
                                         r"but the model outputs 2 values per row, and the "
                                         r"loss takes it in no form: as index"):
        torch_dry_run(torch.nn.Linear(4, 2), torch.nn.CrossEntropyLoss(), CLASSES)


def test_a_rank_hands_its_loss_the_form_the_driver_chose():
    from horovod_spark.estimator._train_torch import _Setup

    setup = _Setup.__new__(_Setup)
    setup.label_forms = ["index"]
    out = torch.zeros(ROWS, 3)
    _, labels = setup.transform_outputs(out, [torch.from_numpy(CLASSES.astype(np.float64))])
    assert labels[0].dtype == torch.int64 and labels[0].shape == (ROWS,)


@pytest.mark.tf
@pytest.mark.parametrize("label,loss,form", [
    (CLASSES.astype(np.float64), "sparse_categorical_crossentropy", "values"),
    (CLASSES.astype(np.int64), "sparse_categorical_crossentropy", "index"),
    (np.eye(3)[CLASSES], "categorical_crossentropy", "values"),
    (rng.normal(size=(ROWS, 3)), "mse", "values"),
])
def test_keras_takes_every_layout_its_loss_takes(label, loss, form):
    keras = pytest.importorskip("keras")
    from horovod_spark.estimator import _keras_io

    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
    shapes, forms = _keras_io.dry_run(net, loss, ["x"], ["y"], {"x": X, "y": label})
    assert shapes == [[3]] and forms == [form]


@pytest.mark.tf
def test_keras_refuses_a_class_index_against_a_one_hot_loss_naming_the_sparse_one():
    keras = pytest.importorskip("keras")
    from horovod_spark.estimator import _keras_io

    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
    with pytest.raises(ValueError, match=r"has shape \[\] per row .* shape \[3\] per row, and "
                                         r"the loss takes it in no form: as values .*; as "
                                         r"index .*sparse_categorical_crossentropy"):
        _keras_io.dry_run(net, "categorical_crossentropy", ["x"], ["y"],
                          {"x": X, "y": CLASSES.astype(np.float64)})
