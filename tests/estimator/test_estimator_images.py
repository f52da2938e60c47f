"""Images and text in TorchEstimator: binary (PNG bytes) and string columns reach the ranks as
numpy arrays of bytes / str, a decode_fn turns them into numbers in threads ahead of the
training step, and the fitted model predicts on the same DataFrame (decode_fn travels with
it, saved and loaded too).  Bad rows are named with their column and partition.

Images: scikit-learn's digits (8x8, 16 grey levels) encoded as PNG with Pillow; text: a
sentence per digit whose words say the label, among noise words.  Nothing downloaded.
"""
import io
import sys

import cloudpickle
import numpy as np
import pytest
import torch

from horovod_spark.estimator import TorchEstimator, TorchModel

pytestmark = pytest.mark.spark
PIL = pytest.importorskip("PIL.Image")
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the decoders reach the executors
ROWS = 600


def _png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    PIL.fromarray((pixels.reshape(8, 8) * 255 / 16).astype(np.uint8), mode="L").save(out, "PNG")
    return out.getvalue()


def decode_png(batch):
    """PNG bytes to 64 floats in [0, 1] (what a user's decode_fn does)."""
    import io

    import numpy as np
    from PIL import Image

    batch["image"] = np.stack([np.asarray(Image.open(io.BytesIO(b)), np.float32).reshape(-1)
                               for b in batch["image"]]) / 255.0
    return batch


def hash_words(batch):
    """Text to a 32-bucket bag of words (a tokenizer's stand-in)."""
    import zlib

    import numpy as np

    out = np.zeros((len(batch["text"]), 32), np.float32)
    for i, sentence in enumerate(batch["text"]):
        for word in sentence.split():
            out[i, zlib.crc32(word.encode()) % 32] += 1.0
    batch["text"] = out
    return batch


@pytest.fixture(scope="module")
def images(spark):
    from sklearn.datasets import load_digits

    data = load_digits()
    rng = np.random.default_rng(0)
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    rows = []
    for i in range(ROWS):
        label = int(data.target[i])
        noise = " ".join(rng.choice(["the", "a", "of", "digit", "shape", "ink"], 3))
        rows.append((i, bytearray(_png(data.data[i])), f"{noise} {words[label]} {noise}", label))
    df = _frame(spark, rows)
    df.cache().count()
    # what the PNGs hold: the 16 grey levels as 8-bit values
    pixels = (data.data[:ROWS] * 255 / 16).astype(np.uint8).astype(np.float32) / 255.0
    return df, pixels, rows


def _frame(spark, rows):
    """Two partitions, rows 0-299 and 300-599, in order (the estimator keeps them)."""
    return spark.createDataFrame(spark.sparkContext.parallelize(rows, 2),
                                 "id int, image binary, text string, label bigint")


def _estimator(tmp_path, feature, width, decode_fn, **kw):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(width, 10))
    args = dict(num_proc=2, model=net, optimizer=torch.optim.Adam(net.parameters(), lr=0.05),
                loss=torch.nn.CrossEntropyLoss(), feature_cols=[feature], label_cols=["label"],
                batch_size=32, epochs=4, store=str(tmp_path), verbose=0, decode_fn=decode_fn)
    args.update(kw)
    return TorchEstimator(**args)


def test_png_images_train_decoded_in_threads_and_the_model_predicts_on_the_same_dataframe(
        images, tmp_path):
    df, pixels, rows = images
    model = _estimator(tmp_path, "image", 64, decode_png, decode_workers=2,
                       validation=0.2).fit(df)
    history = model.getHistory()
    assert history["loss"][-1] < history["loss"][0] * 0.5, history["loss"]
    got = model.transform(df).select("label__output").toPandas()["label__output"]
    predicted = np.stack([np.asarray(v.toArray()) for v in got])
    # the same DataFrame's rows, in the DataFrame's order: decode them here as the UDF does
    ids = np.array([r["id"] for r in df.select("id").collect()])
    with torch.no_grad():  # the rows' own pixels, in the DataFrame's order
        want = model.getModel()(torch.from_numpy(pixels[ids])).numpy()
    np.testing.assert_allclose(predicted, want, rtol=1e-5, atol=1e-5)
    accuracy = (predicted.argmax(1) == np.array([rows[i][3] for i in ids])).mean()
    assert accuracy > 0.8, accuracy
    model.write().overwrite().save(str(tmp_path / "saved"))
    again = TorchModel.load(str(tmp_path / "saved")).transform(df).select("label__output")
    reloaded = np.stack([np.asarray(v.toArray()) for v in again.toPandas()["label__output"]])
    np.testing.assert_allclose(reloaded, predicted, rtol=1e-6, atol=1e-6)


def test_text_trains_through_a_tokenizing_decode_fn_on_the_training_thread(images, tmp_path):
    df, _, _ = images
    model = _estimator(tmp_path, "text", 32, hash_words, decode_workers=0).fit(df)
    history = model.getHistory()
    assert history["loss"][-1] < history["loss"][0] * 0.5, history["loss"]
    out = model.transform(df.limit(20)).select("label", "label__output").collect()
    right = sum(int(np.argmax(r["label__output"].toArray()) == r["label"]) for r in out)
    assert right >= 18, right  # the label's own word is in every sentence


def test_a_binary_column_without_a_decode_fn_is_refused_before_training(images, tmp_path):
    df, _, _ = images
    with pytest.raises(TypeError, match=r"feature column 'image' holds bytes, which the model "
                                        r"can't take: pass decode_fn=fn"):
        _estimator(tmp_path, "image", 64, None).fit(df)


def test_a_null_image_is_named_with_its_column_row_and_partition(spark, images, tmp_path):
    _, _, rows = images
    holed = _frame(spark, [r if r[0] != 450 else (r[0], None) + r[2:] for r in rows])
    with pytest.raises(ValueError, match=r"feature column 'image' has a null \(first in row "
                                         r"150 of partition 1\); drop or fill those rows"):
        _estimator(tmp_path, "image", 64, decode_png).fit(holed)


def test_a_row_that_fails_to_decode_is_named_with_its_batch_partition_and_traceback(
        spark, images, tmp_path):
    _, _, rows = images  # row 450: partition 1 (the driver's checks decode partition 0's first)
    broken = _frame(spark, [r if r[0] != 450 else (r[0], bytearray(b"not a png")) + r[2:]
                            for r in rows])
    with pytest.raises(Exception) as err:
        _estimator(tmp_path, "image", 64, decode_png, decode_workers=2, shuffle=False,
                   epochs=1).fit(broken)
    text = str(err.value)
    assert "on rank 1" in text, text[-3000:]
    assert "DecodeError: decode_fn failed on batch 4 of epoch 0 of partition 1 (rank 1): " \
           "UnidentifiedImageError" in text, text[-3000:]
    assert "in decode_png" in text, text[-3000:]  # the decoder's own frames


def test_sparse_vectors_train_as_dense_rows_and_predict(spark, images, tmp_path):
    from pyspark.ml.linalg import Vectors

    _, pixels, rows = images
    sparse = [(Vectors.sparse(64, {int(j): float(v) for j, v in enumerate(pixels[i]) if v}),
               rows[i][3]) for i in range(ROWS)]
    df = spark.createDataFrame(sparse, ["onehot", "label"]).repartition(2)
    model = _estimator(tmp_path, "onehot", 64, None).fit(df)
    assert model.getHistory()["loss"][-1] < model.getHistory()["loss"][0] * 0.5
    out = model.transform(df).select("onehot", "label__output").limit(8).collect()
    with torch.no_grad():
        want = model.getModel()(torch.tensor(np.stack([r["onehot"].toArray() for r in out]),
                                             dtype=torch.float32)).numpy()
    got = np.stack([r["label__output"].toArray() for r in out])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


class SparseLinear(torch.nn.Module):
    """A linear layer over a sparse batch (torch.sparse.mm); it refuses a dense one, so the
    test knows the rows stayed sparse all the way."""

    def __init__(self, size, classes):
        torch.manual_seed(0)
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(size, classes) * 0.01)
        self.bias = torch.nn.Parameter(torch.zeros(classes))

    def forward(self, x):
        if not x.is_sparse:
            raise TypeError(f"expected a sparse batch, got a dense {tuple(x.shape)}")
        return torch.sparse.mm(x, self.weight) + self.bias


def test_sparse_vectors_stay_sparse_to_a_torch_sparse_model_and_predict(spark, images,
                                                                         tmp_path):
    """sparse_vectors='sparse': 65,536-wide hashed features (what HashingTF makes), which
    the dense path would make 256 KiB a row, train as torch sparse batches."""
    from pyspark.ml.linalg import Vectors

    _, pixels, rows = images
    size = 1 << 16
    slots = np.random.default_rng(0).permutation(size)[:64]  # pixel j's hashed feature
    hashed = [(i, Vectors.sparse(size, sorted((int(slots[j]), float(v))
                                              for j, v in enumerate(pixels[i]) if v)),
               rows[i][3]) for i in range(ROWS)]
    df = spark.createDataFrame(hashed, ["id", "hashed", "label"]).repartition(2)
    net = SparseLinear(size, 10)
    model = _estimator(tmp_path, "hashed", 0, None, model=net, sparse_vectors="sparse",
                       optimizer=torch.optim.Adam(net.parameters(), lr=0.05)).fit(df)
    history = model.getHistory()["loss"]
    assert history[-1] < history[0] * 0.5, history
    out = model.transform(df).select("id", "hashed", "label", "label__output").limit(40).collect()
    dense = torch.tensor(np.stack([r["hashed"].toArray() for r in out]), dtype=torch.float32)
    with torch.no_grad():
        want = (dense @ model.getModel().weight + model.getModel().bias).numpy()
    np.testing.assert_allclose(np.stack([r["label__output"].toArray() for r in out]), want,
                               rtol=1e-4, atol=1e-5)
    model.write().overwrite().save(str(tmp_path / "saved"))
    assert TorchModel.load(str(tmp_path / "saved")).getOrDefault("sparse_vectors") == "sparse"
