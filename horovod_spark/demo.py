"""The main job: a small CNN trained on scikit-learn's digits with 2 ranks on Spark.

    python -m horovod_spark.demo                 # 2 ranks, then the same job on 1 rank
    python -m horovod_spark.demo --epochs 3 --skip-baseline

It runs `HorovodRunner(np=2).run(train, ...)` on the embedded local Spark (or
the active session): every rank trains on its shard of the training images
(rank r takes rows r, r + size, ...) with `hvd.DistributedOptimizer`, the
learning rate scaled by the number of ranks, and reports each step to the
driver's progress bar.  Rank 0 measures the test accuracy and returns the
trained weights, which the driver loads to classify a few test images.

*Throughput* is training samples (images) per second over every rank in the
median epoch (a median, so a moment of load from other processes does not
decide it), as rank 0 times its epochs.  The *baseline* is the
same job on 1 rank (the same epochs and per-rank batch size, so the same
images in all), and *efficiency* = throughput(np) / (np x throughput(1)).
Each rank uses one torch thread, so ranks are what scales.  On a machine
whose cores are shared, the numbers are noisy: read them as a demonstration.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Optional, Sequence

__all__ = ["main", "train", "load_data"]

SEED = 0


def load_data(test_fraction: float = 0.2):
    """(x_train, y_train, x_test, y_test): 8x8 images scaled to [0, 1], as numpy arrays."""
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y.astype(np.int64), test_size=test_fraction, random_state=SEED, stratify=y)
    return x_train, y_train, x_test, y_test


def make_model():
    """Two 3x3 convolutions and a linear layer: 8x8 -> 6x6x16 -> 4x4x32 -> 10 classes."""
    import torch.nn as nn

    return nn.Sequential(nn.Conv2d(1, 16, 3), nn.ReLU(), nn.Conv2d(16, 32, 3), nn.ReLU(),
                         nn.Flatten(), nn.Linear(32 * 4 * 4, 10))


def _epoch(hvd, model, opt, x, y, epoch: int, epochs: int, steps: int, batch_size: int) -> float:
    """One pass over this rank's shard (`steps` batches); returns the last batch's loss."""
    import torch
    import torch.nn.functional as F

    from horovod_spark import progress

    gen = torch.Generator().manual_seed(SEED + 1000 * epoch + hvd.rank())
    order = torch.randperm(len(x), generator=gen)
    loss = torch.zeros(())
    for step in range(steps):
        idx = order[step * batch_size:(step + 1) * batch_size]
        opt.zero_grad()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        progress.report(epoch=epoch, epochs=epochs, step=step, steps=steps, samples=len(idx),
                        loss=float(loss.detach()))
    return float(loss.detach())


def train(data, epochs: int = 8, batch_size: int = 32, lr: float = 0.002) -> dict:
    """The training function every rank runs; rank 0's value comes back to the driver."""
    import torch

    import horovod_spark.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    x_train, y_train, x_test, y_test = (torch.from_numpy(a) for a in data)
    x, y = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]
    steps = len(x_train) // hvd.size() // batch_size  # the same on every rank: shards differ by 1
    torch.manual_seed(SEED)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=lr * hvd.size())  # scale lr with the ranks
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.barrier()
    times = []
    for epoch in range(epochs):
        began = time.perf_counter()
        loss = _epoch(hvd, model, opt, x, y, epoch, epochs, steps, batch_size)
        times.append(time.perf_counter() - began)
    per_epoch = steps * batch_size * hvd.size()  # samples, over every rank
    metrics = hvd.metrics()
    with torch.no_grad():
        accuracy = float((model(x_test).argmax(1) == y_test).float().mean())
    return {"ranks": hvd.size(), "accuracy": accuracy, "loss": loss, "seconds": sum(times),
            "samples": per_epoch * epochs, "throughput": per_epoch / statistics.median(times),
            "allreduce_share": min(metrics["allreduce_time_s"] / max(metrics["step_time_s"],
                                                                     1e-12), 1.0),
            "state_dict": model.state_dict() if hvd.rank() == 0 else None}


def _run(np_: int, data, ns) -> dict:
    from horovod_spark import HorovodRunner

    began = time.perf_counter()
    result = HorovodRunner(np=np_, verbose=ns.verbose).run(
        train, data=data, epochs=ns.epochs, batch_size=ns.batch_size, lr=ns.lr)
    result["job_seconds"] = time.perf_counter() - began
    return result


def _use_on_driver(result: dict, x_test, y_test, shown: int = 12) -> str:
    """The returned weights, loaded into a fresh model here, classify a few test images."""
    import torch

    model = make_model()
    model.load_state_dict(result["state_dict"])
    with torch.no_grad():
        pred = model(torch.from_numpy(x_test[:shown])).argmax(1).tolist()
    return (f"the model rank 0 returned, on the driver, reads the first {shown} test digits:\n"
            f"  predicted: {' '.join(map(str, pred))}\n"
            f"  true:      {' '.join(map(str, y_test[:shown]))}")


def _table(results: Sequence[dict]) -> str:
    lines = [f"{'ranks':>5}  {'test accuracy':>13}  {'samples/s':>10}  {'train time':>10}  "
             f"{'allreduce share':>15}  {'job time':>8}"]
    for r in results:
        lines.append(f"{r['ranks']:>5}  {100 * r['accuracy']:>12.1f}%  {r['throughput']:>10,.0f}  "
                     f"{r['seconds']:>9.2f}s  {100 * r['allreduce_share']:>14.0f}%  "
                     f"{r['job_seconds']:>7.1f}s")
    return "\n".join(lines)


def _scaling(main: dict, base: dict) -> str:
    speedup = main["throughput"] / base["throughput"]
    efficiency = speedup / main["ranks"]
    cores = os.cpu_count() or 1
    return (f"scaling, {main['ranks']} ranks vs 1: {speedup:.2f}x the samples/s, efficiency "
            f"{100 * efficiency:.0f}% ({cores} CPU cores on this machine; shared cores make "
            f"this noisy)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m horovod_spark.demo", description=__doc__.split(
        "\n")[0])
    p.add_argument("--np", type=int, default=2, help="ranks (Spark barrier tasks); default 2")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.002, help="for 1 rank; scaled by the ranks")
    p.add_argument("--skip-baseline", action="store_true", help="don't run the 1-rank job")
    p.add_argument("--verbose", type=int, default=1, help="0: no progress bar")
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    ns = _parser().parse_args(argv)
    if ns.np < 1 or ns.epochs < 1 or ns.batch_size < 1:
        raise SystemExit("--np, --epochs and --batch-size must be >= 1")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # one thread per rank: ranks scale
        os.environ.setdefault(var, "1")
    data = load_data()
    print(f"horovod-spark demo: a CNN on scikit-learn's digits ({len(data[0])} training, "
          f"{len(data[2])} test images), {ns.epochs} epochs, batch {ns.batch_size} per rank",
          flush=True)
    results = [_run(ns.np, data, ns)]
    print(_use_on_driver(results[0], data[2], data[3]), flush=True)
    if not ns.skip_baseline and ns.np != 1:
        print("the same job on 1 rank, for the scaling:", flush=True)
        results.append(_run(1, data, ns))
    print(_table(results))
    if len(results) > 1:
        print(_scaling(results[0], results[1]))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "state_dict"} for r in results], f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
