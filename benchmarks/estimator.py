"""TorchEstimator.fit: rows per second, and the share of fit time that is not training.

    python benchmarks/estimator.py [--rows 1000000] [--features 32] [--epochs 3]
                                   [--batch-size 256] [--num-proc 2] [--json out.json]
                                   [--conf KEY=VALUE ...]

Data: ``rows`` x ``features`` float features (an ml Vector column, as a
VectorAssembler makes it) and a regression label, written once to Parquet
(not timed).  Model: a small MLP (features -> 64 -> 64 -> 1, MSE, Adam).

Cases, each one ``fit`` on a warm local[num_proc] session: a one-epoch fit of
4096 rows first starts the session's Python workers and leaves each a zygote
(warm starts: the next fit's ranks fork from a process that has imported torch),
then ``--settle`` seconds (default 10, a notebook's pause between cells) let the
zygotes finish their imports; ``--settle 0`` times a fit that follows at once.
  parquet, pyarrow          ``fit_on_parquet(path)`` (num_proc files): each task reads
            its share of the row groups with pyarrow, spills it and its rank trains;
  parquet via Spark, 16 MB  ``fit(spark.read.parquet(path))`` read in 16 MB splits: the
            JVM decodes the files (vectors to arrays on the JVM, Arrow to Python)
            and the fit repartitions to num_proc first (one shuffle);
  cached    ``fit(df)`` of a cached DataFrame that already has num_proc partitions
            (no shuffle: each task hands its cached partition to its rank).
Reference: the same model and batches trained by torch alone, in one process, on
in-memory tensors of rows / num_proc rows (a rank's share), no Spark at all.

Columns: rows/s = rows x epochs / fit time; *check* = the driver's checks
(schema, a 16-row sample, the dry run); *spill* = rank 0's task reading its
partition from Spark (vectors to arrays on the JVM, Arrow to Python) and
spilling it to local Arrow; *train* = the ranks' epochs; prep % = (check +
spill) / fit; not train % = (fit - train) / fit, which adds the rank processes
starting (python, torch, hvd.init), the census and the result coming back.  The
rank starts while its task spills, so spill and start overlap (see the
timeline).  Target: prep <= 20% of fit.  CPU seconds, where the wall times
above mostly measure a share of 2 busy cores: *spill cpu* = the Python side of
rank 0's spill (its thread: Arrow from the JVM, checks, writes); *jvm cpu* = the
driver JVM during the whole fit (local mode: both tasks' reading, vectors to
arrays and Arrow writing, plus the driver's own work); *train cpu* = rank 0's
process (both its threads) from the first epoch to the last; *start cpu* =
rank 0's process before its first epoch (python, torch and torch._dynamo
imports, hvd.init, the census, the model's setup), which every rank spends
while its task spills; *wait s* = how long rank 0, initialized, waited for its
spill (the part of the spill on the fit's critical path).

    --conf KEY=VALUE   a Spark conf for the session, e.g.
                       spark.sql.execution.arrow.maxBytesPerBatch=2147483647

Horovod's TorchEstimator would run side by side when ``horovod.spark.torch``
imports.  It does not install here: horovod 0.28.1 (the last release, 2023)
compiles its torch extension as C++14 and torch >= 2.1 requires C++17
(horovod/horovod#3996, #4014; the fix, #3998, was merged after the release), so
the row reports the ImportError.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _session(num_proc: int, confs=()):
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
    spark = (SparkSession.builder.master(f"local[{num_proc}]").appName("bench-estimator")
             .config("spark.executorEnv.PYTHONPATH", ROOT)
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.memory", "4g")
             .config("spark.sql.shuffle.partitions", str(num_proc)))
    for conf in confs:
        spark = spark.config(*conf.split("=", 1))
    spark = spark.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _data(spark, rows: int, features: int, path: str):
    from pyspark.ml.feature import VectorAssembler
    from pyspark.sql import functions as F

    w = np.random.default_rng(0).normal(size=features)
    cols = [F.rand(seed=i).cast("float").alias(f"f{i}") for i in range(features)]
    df = spark.range(rows).select(*cols)
    label = sum(F.col(f"f{i}") * float(w[i]) for i in range(features))
    df = df.withColumn("label", label.cast("float"))
    df = VectorAssembler(inputCols=[f"f{i}" for i in range(features)],
                         outputCol="features").transform(df).select("features", "label")
    df.coalesce(spark.sparkContext.defaultParallelism).write.mode("overwrite").parquet(path)


def _estimator(args, store: str):
    import torch

    from horovod_spark.estimator import TorchEstimator

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(args.features, 64), torch.nn.ReLU(),
                              torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    return TorchEstimator(num_proc=args.num_proc, model=net,
                          optimizer=torch.optim.Adam(net.parameters(), lr=1e-3),
                          loss=torch.nn.MSELoss(), feature_cols=["features"],
                          label_cols=["label"], batch_size=args.batch_size, epochs=args.epochs,
                          store=store, verbose=0)


def _small_splits(spark, est, path: str):
    """A Parquet read by Spark in many partitions, so the fit repartitions (one shuffle)."""
    spark.conf.set("spark.sql.files.maxPartitionBytes", str(16 << 20))
    try:
        return est.fit(spark.read.parquet(path))
    finally:
        spark.conf.unset("spark.sql.files.maxPartitionBytes")


def _jvm_cpu(spark) -> float:
    """CPU seconds of the driver's JVM so far: in local mode, the executors' too."""
    pid = int(spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid())
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _row(case: str, args, est, model, seconds: float, jvm_cpu: float) -> dict:
    t = est._last_timings
    prep = t["check_seconds"] + t["data_seconds"]
    train = t["train_seconds"]
    start = max(seconds - train - prep, 0.0)
    return {"case": case, "rows": args.rows, "epochs": args.epochs, "fit_s": seconds,
            "rows_per_s": args.rows * args.epochs / seconds, "prep_s": prep, "start_s": start,
            "train_s": train, "prep_share": prep / seconds, "check_s": t["check_seconds"],
            "spill_s": t["data_seconds"], "not_train_share": (seconds - train) / seconds,
            "spill_cpu_s": t.get("data_cpu_seconds"), "jvm_cpu_s": jvm_cpu,
            "train_cpu_s": t.get("rank_cpu_seconds"), "start_cpu_s": t.get("rank_start_cpu_seconds"),
            "wait_s": _data_wait(t["stamps"]),
            "final_loss": model.getHistory()["loss"][-1], "phases": _phases(t["stamps"])}


STAMPS = (("stage_start", "the barrier stage is submitted"),
          ("task_start", "rank 0's task starts (and starts its rank process)"),
          ("rank_entry", "the rank process runs (python and torch imported, or forked warm)"),
          ("initialized", "hvd.init done (the ranks met at the job store)"),
          ("spilled", "the task has spilled its partition"),
          ("agreed", "the ranks have agreed on the census"),
          ("ready", "shard mapped, model built, parameters broadcast"),
          ("trained", "the last epoch is done"),
          ("stage_end", "the result is back on the driver"))


def _data_wait(stamps: dict) -> float:
    """Seconds rank 0 waited for its task's census after hvd.init: the spill's share of
    the critical path (0 when the spill ended while the rank was still starting)."""
    if "census_read" not in stamps or "initialized" not in stamps:
        return 0.0
    return max(0.0, stamps["census_read"] - stamps["initialized"])


def _phases(stamps: dict) -> list:
    """(what, seconds since the stage was submitted): the task spills while its rank starts."""
    base = stamps.get("stage_start", 0.0)
    return [(label, stamps[k] - base) for k, label in STAMPS if k in stamps]


def _torch_alone(args) -> dict:
    """One process, a rank's share of rows in memory, the same model and batch size."""
    import torch

    torch.set_num_threads(1)
    n = args.rows // args.num_proc
    x = torch.rand(n, args.features)
    y = x @ torch.randn(args.features, 1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(args.features, 64), torch.nn.ReLU(),
                              torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    loss_fn = torch.nn.MSELoss()
    began = time.perf_counter()
    for _ in range(args.epochs):
        perm = torch.randperm(n)
        for i in range(0, n, args.batch_size):
            idx = perm[i:i + args.batch_size]
            opt.zero_grad()
            loss_fn(net(x[idx]), y[idx]).backward()
            opt.step()
    seconds = time.perf_counter() - began
    return {"case": "torch alone (1 process, a rank's rows)", "rows": n, "epochs": args.epochs,
            "fit_s": seconds, "rows_per_s": n * args.epochs / seconds, "prep_s": 0.0,
            "start_s": 0.0, "train_s": seconds, "prep_share": 0.0, "check_s": 0.0,
            "spill_s": 0.0, "not_train_share": 0.0, "spill_cpu_s": 0.0, "jvm_cpu_s": 0.0,
            "train_cpu_s": seconds, "wait_s": 0.0, "final_loss": float("nan")}


def _horovod_row() -> dict:
    try:
        import horovod.spark.torch  # noqa: F401
    except Exception as exc:  # not installed, or built without torch
        return {"case": "horovod.spark.torch.TorchEstimator", "skipped":
                f"not installed here ({type(exc).__name__}: {exc})"}
    return {"case": "horovod.spark.torch.TorchEstimator",
            "skipped": "installed, but this benchmark does not drive Petastorm yet"}


def _num(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def _print(rows: list) -> None:
    head = f"{'case':<40} {'rows/s':>10} {'fit s':>7} {'check s':>8} {'spill s':>8} " \
           f"{'train s':>8} {'prep %':>7} {'not train %':>12} {'spill cpu':>9} {'jvm cpu':>8} " \
           f"{'train cpu':>9} {'start cpu':>9} {'wait s':>7}"
    print(head)
    print("-" * len(head))
    for r in rows:
        if "skipped" in r:
            print(f"{r['case']:<40} {r['skipped']}")
            continue
        print(f"{r['case']:<40} {r['rows_per_s']:>10.0f} {r['fit_s']:>7.2f} {r['check_s']:>8.2f} "
              f"{r['spill_s']:>8.2f} {r['train_s']:>8.2f} {100 * r['prep_share']:>6.1f}% "
              f"{100 * r['not_train_share']:>11.1f}% {_num(r['spill_cpu_s']):>9} "
              f"{_num(r['jvm_cpu_s']):>8} {_num(r['train_cpu_s']):>9} "
              f"{_num(r.get('start_cpu_s')):>9} {_num(r.get('wait_s')):>7}")
    for r in rows:
        if r.get("phases"):
            print(f"\ntimeline of '{r['case']}' (seconds after the stage was submitted):")
            for label, seconds in r["phases"]:
                print(f"  {seconds:>7.2f} s  {label}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--num-proc", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--settle", type=float, default=10.0,
                   help="seconds between the warm-up fit and the timed ones (default 10)")
    p.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                   help="a Spark conf for the session (repeatable)")
    args = p.parse_args()
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    spark = _session(args.num_proc, args.conf)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-estimator-") as tmp:
        path = os.path.join(tmp, "data.parquet")
        _data(spark, args.rows, args.features, path)
        cached = spark.read.parquet(path).repartition(args.num_proc).cache()
        cached.count()
        _estimator(args, os.path.join(tmp, "warm")).setEpochs(1).fit(cached.limit(4096))
        time.sleep(args.settle)  # the workers' zygotes finish their imports (warm starts)
        for case, run in (("parquet, pyarrow in the tasks",
                           lambda est: est.fit_on_parquet(path)),
                          ("parquet via Spark, 16 MB splits",
                           lambda est: _small_splits(spark, est, path)),
                          ("cached, num_proc partitions", lambda est: est.fit(cached))):
            est = _estimator(args, os.path.join(tmp, "store"))
            began, cpu = time.perf_counter(), _jvm_cpu(spark)
            model = run(est)
            seconds = time.perf_counter() - began
            results.append(_row(case, args, est, model, seconds, _jvm_cpu(spark) - cpu))
    results.append(_torch_alone(args))
    results.append(_horovod_row())
    import horovod_spark

    print(f"TorchEstimator.fit: {args.rows} rows x {args.features} float features, MLP, "
          f"{args.epochs} epochs, batch {args.batch_size}, num_proc {args.num_proc} "
          f"(local[{args.num_proc}], {os.cpu_count()} cores; code in "
          f"{os.path.dirname(os.path.dirname(horovod_spark.__file__))}"
          f"{'; ' + ', '.join(args.conf) if args.conf else ''})")
    _print(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    spark.stop()


if __name__ == "__main__":
    main()
