"""TorchEstimator on images stored as PNG bytes: decode_fn in threads, on the training thread,
and the ceiling (the same model on pixels already decoded), in one run, interleaved.

    python benchmarks/estimator_images.py                  # 20,000 images of 64x64, 2 ranks
    python benchmarks/estimator_images.py --images 100000 --rounds 1
    python benchmarks/estimator_images.py --np 1 --workers 1   # a spare core for decoding

Images: scikit-learn's digits upscaled to 64x64 with per-image noise (so PNG compresses
them as it would photos' texture: about 3-4 KB each), labels the digits.  Model: a small
CNN (two 3x3 convolutions, 8 and 16 channels, stride 2, then a linear layer), batch 64,
Adam, 2 epochs, num_proc=2 on local[2].  Variants:

  threads     binary column + decode_fn (Pillow), decode_workers=2
  inline      binary column + decode_fn, decode_workers=0 (on the training thread)
  decoded     an array<float> column of the 4096 pixels, no decode (the ceiling: what
              training costs when decoding is free)
  parquet     what users fall back to without an estimator: the PNG DataFrame written to
              Parquet, then pyspark's TorchDistributor (DDP over Gloo) with a torch
              DataLoader over pyarrow on each rank, decoding in `workers` loader processes

Petastorm (``make_spark_converter``, the Databricks docs' way before this package) is not an
arm: its last release (0.13.1, 2023) imports only with pyarrow < 14 (it uses
``pyarrow.filesystem`` and ParquetDataset's legacy arguments), and pyspark 4's
TorchDistributor refuses pyarrow < 18 (``mapInArrow``), so the two cannot run together.

Samples/s per rank are from rank 0's training time (``train_seconds``: the epochs alone, not
the spill or the start).  The machine is shared: the JSON under benchmarks/results/ records
the load average.
"""
from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _peers import load  # noqa: E402
from _table import write_json  # noqa: E402

VARIANTS = ("threads", "inline", "decoded", "parquet")


def _images(n: int, seed: int = 0):
    """(pixels uint8 [n, 64, 64], labels): digits upscaled 8x with noise."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(digits.target), n)
    base = np.kron(digits.images[pick] / 16.0, np.ones((8, 8)))  # [n, 64, 64] in [0, 1]
    noisy = np.clip(base * 200 + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    return noisy, digits.target[pick].astype(np.int64)


def _png(img: np.ndarray) -> bytearray:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(img, mode="L").save(out, "PNG")
    return bytearray(out.getvalue())


def decode(batch):
    import io

    import numpy as np
    from PIL import Image

    batch["image"] = np.stack([np.asarray(Image.open(io.BytesIO(b)), np.float32)
                               for b in batch["image"]])[:, None] / 255.0
    return batch


def _net():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 16, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(16 * 16 * 16, 10))


def parquet_train(path: str, steps: int, batch: int, workers: int) -> dict:
    """The `parquet` arm's rank (under TorchDistributor): a DataLoader over this rank's
    Parquet files, PNGs decoded in its worker processes, DDP over Gloo."""
    import glob
    import io
    import time

    import numpy as np
    import pyarrow.parquet as pq
    import torch
    import torch.distributed as dist
    from PIL import Image

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    files = sorted(glob.glob(f"{path}/*.parquet"))[rank::size]

    class Rows(torch.utils.data.IterableDataset):
        def __iter__(self):  # every epoch again; each loader worker decodes its share
            info = torch.utils.data.get_worker_info()
            wid, nw = (info.id, info.num_workers) if info else (0, 1)
            while True:
                for f in files:
                    table = pq.read_table(f, columns=["image", "label"])
                    images, labels = table["image"].to_pylist(), table["label"].to_pylist()
                    for i in range(wid * batch, len(images), nw * batch):
                        for b, y in zip(images[i:i + batch], labels[i:i + batch]):
                            pixels = np.asarray(Image.open(io.BytesIO(b)), np.float32)[None]
                            yield torch.from_numpy(pixels / 255.0), y

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(_net())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss()
    loader = torch.utils.data.DataLoader(Rows(), batch_size=batch, num_workers=workers)
    began, loss = None, float("nan")
    for i, (x, y) in enumerate(loader):
        if i == 1:
            began = time.perf_counter()
        opt.zero_grad()
        out = loss_fn(model(x), y)
        out.backward()
        opt.step()
        loss = out.item()
        if i + 1 >= steps:
            break
    seconds = time.perf_counter() - began
    dist.destroy_process_group()
    return {"train_s": seconds, "samples": (steps - 1) * batch, "loss": loss}


def fit_parquet(frames: dict, epochs: int, batch: int, np_: int, workers: int) -> dict:
    from pyspark.ml.torch.distributor import TorchDistributor

    rows = frames["rows"]
    steps = -(-rows // (np_ * batch)) * epochs
    began = time.perf_counter()
    path = tempfile.mkdtemp(prefix="hvs-bench-parquet-")
    frames["png"].write.mode("overwrite").parquet(path)
    result = TorchDistributor(num_processes=np_, local_mode=False, use_gpu=False).run(
        parquet_train, path, steps, batch, workers)
    return {"samples_per_s_per_rank": result["samples"] / result["train_s"],
            "train_s": result["train_s"], "fit_s": time.perf_counter() - began,
            "final_loss": result["loss"]}


def fit(variant: str, frames: dict, epochs: int, batch: int, np_: int = 2,
        workers: int = 2) -> dict:
    import torch

    if variant == "parquet":
        return fit_parquet(frames, epochs, batch, np_, workers)

    from horovod_spark.estimator import TorchEstimator

    net = _net()
    kw = dict(num_proc=np_, model=net, optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
              loss=torch.nn.CrossEntropyLoss(), label_cols=["label"], batch_size=batch,
              epochs=epochs, verbose=0, store=tempfile.mkdtemp(prefix="hvs-bench-"))
    if variant == "decoded":
        est = TorchEstimator(feature_cols=["pixels"], input_shapes=[[-1, 1, 64, 64]], **kw)
        df = frames["decoded"]
    else:
        est = TorchEstimator(feature_cols=["image"], decode_fn=decode,
                             decode_workers=workers if variant == "threads" else 0, **kw)
        df = frames["png"]
    began = time.perf_counter()
    model = est.fit(df)
    wall = time.perf_counter() - began
    t = est._last_timings
    rows = frames["rows"]
    steps = -(-rows // (np_ * batch))
    return {"samples_per_s_per_rank": steps * batch * epochs / t["train_seconds"],
            "train_s": t["train_seconds"], "fit_s": wall,
            "final_loss": model.getHistory()["loss"][-1]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=20000)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--np", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--workers", type=int, default=2, help="decode_workers of `threads`")
    p.add_argument("--rounds", type=int, default=2, help="each variant this many times, "
                   "interleaved; the median counts")
    args = p.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").appName("images-bench")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.memory", "6g").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    began, before = time.perf_counter(), load()
    pixels, labels = _images(args.images)
    pngs = [_png(img) for img in pixels]
    png_bytes = sum(len(b) for b in pngs)
    png = spark.createDataFrame(spark.sparkContext.parallelize(
        list(zip(pngs, labels.tolist())), args.np), "image binary, label bigint").cache()
    flat = spark.createDataFrame(spark.sparkContext.parallelize(
        [((img.reshape(-1) / 255.0).astype(np.float32).tolist(), int(y))
         for img, y in zip(pixels, labels)], args.np), "pixels array<float>, label bigint").cache()
    png.count(), flat.count()
    frames = {"png": png, "decoded": flat, "rows": args.images}
    print(f"# {args.images} images of 64x64, PNG {png_bytes / args.images / 1024:.1f} KiB "
          f"each ({png_bytes / 2**20:.0f} MiB), {args.np} rank(s) on local[2] (threads: "
          f"decode_workers={args.workers}), batch {args.batch}, "
          f"{args.epochs} epochs; data ready in {time.perf_counter() - began:.0f} s")
    results = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            results[variant].append(fit(variant, frames, args.epochs, args.batch, args.np,
                                        args.workers))
    ceiling = statistics.median(r["samples_per_s_per_rank"] for r in results["decoded"])
    print(f"# {'variant':>8} {'samples/s/rank':>15} {'of decoded':>11} {'train s':>8} "
          f"{'fit s':>7} {'loss':>6}")
    summary = {}
    for variant, runs in results.items():
        rate = statistics.median(r["samples_per_s_per_rank"] for r in runs)
        train = statistics.median(r["train_s"] for r in runs)
        fit_s = statistics.median(r["fit_s"] for r in runs)
        summary[variant] = {"samples_per_s_per_rank": rate, "of_decoded": rate / ceiling,
                            "runs": runs}
        print(f"  {variant:>8} {rate:>15.0f} {rate / ceiling:>10.2f}x {train:>8.1f} "
              f"{fit_s:>7.1f} {runs[-1]['final_loss']:>6.3f}")
    print(f"# load average {before} -> {load()}; {time.perf_counter() - began:.0f} s")
    path = write_json("estimator_images", {"args": vars(args), "summary": summary})
    print(f"# JSON: {os.path.relpath(path)}")
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
