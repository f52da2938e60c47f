"""Launch time of the drop-in distributors against the ones they replace, on one warm session.

    python benchmarks/distributors.py [--np 2] [--reps 3] [--cases tf,deepspeed,jax]

Each case runs the smallest real job of its framework end to end on the driver (submit,
start the ranks, run, gather), as every rank of np barrier tasks (local[np]):

  tf         a MultiWorkerMirroredStrategy all-reduce of one value:
             horovod_spark.MirroredStrategyRunner  vs  spark_tensorflow_distributor's
  deepspeed  deepspeed.initialize and one ZeRO-1 step of a tiny model (CPU, gloo):
             horovod_spark.DeepspeedTorchDistributor  vs  pyspark.ml.deepspeed's
  jax        jax.distributed.initialize() and one psum: horovod_spark.run (JAX has no Spark
             runner to compare with)

Each runner is warmed up once, then timed `--reps` times, taking turns.  Prints a table
(median, min, ratio = ours / theirs) and writes JSON to benchmarks/results/.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _table import write_json  # noqa: E402


def tf_all_reduce():
    import tensorflow as tf

    strategy = tf.distribute.get_strategy()

    @tf.function
    def step():
        return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM,
                                                              tf.constant([1.0]))

    return float(strategy.experimental_local_results(strategy.run(step))[0][0])


def ds_step():
    import deepspeed
    import torch

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config={
        "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True})
    loss = engine(torch.ones(2, 4)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    return float(loss)


def jax_psum():
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize()
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")),
                                               np.ones((1,), np.float32))
    return float(jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x))


def _runners(case: str, n: int) -> dict:
    cpu = {"CUDA_VISIBLE_DEVICES": ""}
    if case == "tf":
        import horovod_spark

        out = {"ours": lambda: horovod_spark.MirroredStrategyRunner(
            num_slots=n, use_gpu=False, verbose=0).run(tf_all_reduce)}
        try:
            from spark_tensorflow_distributor import MirroredStrategyRunner
        except ImportError:
            return out
        out["spark-tensorflow-distributor"] = lambda: MirroredStrategyRunner(
            num_slots=n, use_gpu=False).run(tf_all_reduce)
        return out
    if case == "deepspeed":
        import horovod_spark

        os.environ.update(cpu)  # pyspark's ranks inherit the executors' environment
        out = {"ours": lambda: horovod_spark.DeepspeedTorchDistributor(
            numGpus=1, nnodes=n, localMode=False, useGpu=False, verbose=0,
            env=cpu).run(ds_step)}
        from pyspark.ml.deepspeed.deepspeed_distributor import DeepspeedTorchDistributor

        out["pyspark DeepspeedTorchDistributor"] = lambda: DeepspeedTorchDistributor(
            numGpus=1, nnodes=n, localMode=False, useGpu=False).run(ds_step)
        return out
    import horovod_spark

    return {"ours": lambda: horovod_spark.run(jax_psum, num_proc=n, verbose=0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cases", default="tf,deepspeed,jax")
    args = ap.parse_args()
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (SparkSession.builder.master(f"local[{args.np}]").appName("distributors-benchmark")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.executorEnv.PYTHONPATH", os.path.dirname(HERE))
             .config("spark.executorEnv.CUDA_VISIBLE_DEVICES", "").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    rows = []
    for case in args.cases.split(","):
        runners = _runners(case, args.np)
        times = {name: [] for name in runners}
        for name, fn in runners.items():
            fn()  # warm up: workers started, imports cached
        for _ in range(args.reps):
            for name, fn in runners.items():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        ours = statistics.median(times["ours"])
        for name, ts in times.items():
            rows.append({"case": case, "runner": name, "median_s": statistics.median(ts),
                         "min_s": min(ts), "ratio": ours / statistics.median(ts)})
    print(f"| case | runner | median s | min s | ours / it |\n| --- | --- | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['case']} | {r['runner']} | {r['median_s']:.2f} | {r['min_s']:.2f} | "
              f"{r['ratio']:.2f}x |")
    print(write_json("distributors", {"np": args.np, "reps": args.reps, "rows": rows}))


if __name__ == "__main__":
    main()
