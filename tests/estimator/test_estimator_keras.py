"""KerasEstimator on real Spark (local[2]): digits, resume, save/load of the model."""
import numpy as np
import pytest

keras = pytest.importorskip("keras")

from horovod_spark.estimator import KerasEstimator, KerasModel, LocalStore  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.tf, pytest.mark.slow]


def _classifier(store, **kw):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    args = dict(num_proc=2, model=model, optimizer=keras.optimizers.Adam(0.01),
                loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                feature_cols=["features"], label_cols=["label"], batch_size=32, epochs=5,
                store=store, verbose=0)
    args.update(kw)
    return KerasEstimator(**args)


def _test_accuracy(model, test_df):
    rows = model.transform(test_df).select("label", "label__output").collect()
    return np.mean([np.argmax(r.label__output.toArray()) == r.label for r in rows])


def test_a_keras_classifier_on_digits_reaches_90_percent_and_resumes(digits, tmp_path):
    train, test, _ = digits
    store = LocalStore(str(tmp_path / "store"))
    first = _classifier(store, epochs=2, run_id="keras-run", validation=0.1).fit(train)
    assert isinstance(first, KerasModel)
    assert store.checkpoint_epochs("keras-run") == [0, 1]
    second = _classifier(store, epochs=5, run_id="keras-run", validation=0.1).fit(train)
    h1, h2 = first.getHistory(), second.getHistory()
    assert set(h2) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert len(h2["loss"]) == 5 and h2["loss"][:2] == h1["loss"]
    assert h2["loss"][2] < h1["loss"][0]
    assert h2["val_accuracy"][-1] >= 0.9
    assert _test_accuracy(second, test) >= 0.9


def test_a_keras_model_saves_loads_and_predicts_the_same(spark, digits, tmp_path):
    _, test, (x_test, _) = digits
    keras.utils.set_random_seed(1)
    net = keras.Sequential([keras.Input((64,)), keras.layers.Dense(3)])
    model = KerasModel.from_keras(net, feature_cols=["features"], label_cols=["label"])
    model.write().overwrite().save(str(tmp_path / "m"))
    loaded = KerasModel.load(str(tmp_path / "m"))
    rows = loaded.transform(test).collect()
    got = np.array([r.label__output.toArray() for r in rows])
    want = net.predict_on_batch(np.array([r.features.toArray() for r in rows], np.float32))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert len(rows) == len(x_test)


def test_a_keras_label_that_does_not_match_the_output_is_refused(digits, tmp_path):
    train, _, _ = digits
    with pytest.raises(ValueError, match=r"label column 'label' has shape \[\] per row but the "
                                         r"model's output for it has shape \[2, 5\] per row"):
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10),
                                  keras.layers.Reshape((2, 5))])
        _classifier(str(tmp_path), model=model, loss="mse").fit(train)


def test_png_bytes_train_a_keras_model_through_decode_fn_and_it_predicts_on_them(spark,
                                                                                tmp_path):
    """Binary columns in KerasEstimator: decode_fn on the ranks (in threads), in the driver's
    checks and in transform, as TorchEstimator's."""
    pytest.importorskip("PIL.Image")
    from sklearn.datasets import load_digits

    from test_estimator_images import _png, decode_png

    data = load_digits()
    rows = [(bytearray(_png(data.data[i])), int(data.target[i])) for i in range(400)]
    df = spark.createDataFrame(spark.sparkContext.parallelize(rows, 2),
                               "image binary, label bigint")
    model = _classifier(str(tmp_path), feature_cols=["image"], decode_fn=decode_png,
                        decode_workers=2, epochs=6).fit(df)
    assert model.getHistory()["accuracy"][-1] > 0.8, model.getHistory()
    got = np.array([r.label__output.toArray()
                    for r in model.transform(df.limit(32)).select("label__output").collect()])
    pixels = (data.data[:32] * 255 / 16).astype(np.uint8).astype(np.float32) / 255.0
    want = model.getModel().predict_on_batch(pixels)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_token_lists_of_their_own_lengths_train_a_keras_model_padded_to_each_batch(spark,
                                                                                  tmp_path):
    """array_padding in KerasEstimator: each batch padded to its longest row with a padding
    token the embedding masks, in training and in transform."""
    from sklearn.datasets import load_digits

    data = load_digits()
    rows = [([int(j) for j in np.flatnonzero(data.data[i] > 4)], int(data.target[i]))
            for i in range(400)]
    df = spark.createDataFrame(spark.sparkContext.parallelize(rows, 2),
                               "tokens array<int>, label bigint")
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((None,)),
                            keras.layers.Embedding(65, 16, mask_zero=False),
                            keras.layers.GlobalAveragePooling1D(),
                            keras.layers.Dense(10, activation="softmax")])
    model = _classifier(str(tmp_path), model=net, feature_cols=["tokens"], epochs=6,
                        array_padding={"tokens": ("longest", 64)}, validation=0.2).fit(df)
    assert model.getHistory()["accuracy"][-1] > 0.6, model.getHistory()
    assert model.getHistory()["val_loss"][-1] < model.getHistory()["val_loss"][0]
    out = model.transform(df.limit(16)).select("tokens", "label__output").collect()
    got = np.array([r.label__output.toArray() for r in out])
    width = max(len(r.tokens) for r in out)
    padded = np.array([r.tokens + [64] * (width - len(r.tokens)) for r in out], np.float32)
    np.testing.assert_allclose(got, model.getModel().predict_on_batch(padded),
                               rtol=1e-5, atol=1e-5)


def test_sparse_vectors_kept_sparse_are_refused_by_keras_before_training(spark, tmp_path):
    from pyspark.ml.linalg import Vectors

    df = spark.createDataFrame([(Vectors.sparse(64, {1: 1.0}), 0)] * 8, ["features", "label"])
    with pytest.raises(ValueError, match=r"TypeError: KerasEstimator takes ml Vector columns "
                                         r"dense: leave sparse_vectors at 'dense'"):
        _classifier(str(tmp_path), sparse_vectors="sparse").fit(df)
