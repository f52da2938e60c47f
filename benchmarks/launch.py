"""Launch overhead: horovod_spark.run vs PySpark's TorchDistributor on one warm session.

    python benchmarks/launch.py [--np 2] [--reps 7] [--master local[2]]
                                [--cases noop,bootstrap,torch] [--connect] [--fresh-workers]

Three cases, each timed end to end on the driver (submit, start ranks, run, gather):
  noop       run(lambda: 0)                           vs  TorchDistributor.run(lambda: 0)
  bootstrap  collectives.init + one 1 MiB float32     vs  init_process_group("gloo") + all_reduce
             allreduce (no framework)
  torch      import torch, hvd.init + one 1 MiB       vs  the same as bootstrap (which imports
             hvd.allreduce                                torch too)

Runners: horovod_spark as it ships (warm starts, the driver's job store);
``hs no-warm`` with HOROVOD_SPARK_WARM_START=0 (every rank a fresh python);
``hs allGather`` with warm starts off and HOROVOD_SPARK_RENDEZVOUS=spark (the
ranks meet through one BarrierTaskContext.allGather: how a job started before
both existed); ``hs dataframe stage``, the classic session running the barrier ``mapInArrow``
DataFrame stage that Connect sessions run, instead of its barrier RDD stage;
and TorchDistributor.

``--connect`` adds a local Spark Connect server (pyspark's own, master --master, in
processes of its own: tests/connect_server.py) and two runners on a Connect client of
it, timed in the same rounds: ``hs Connect`` (ours as it ships there: the client on
this machine is reachable, so the client's job store and live output) and
``TorchDistributor Connect``.  Their ratio column compares with TorchDistributor on
Connect, and ``vs classic`` with ours on the classic session.

``--fresh-workers`` stops Spark's Python workers before each timed run, as Spark does to
workers idle for a minute: what a job pays that comes more than a minute after the last
(a fresh worker for each task; an Arrow worker also imports pandas and pyarrow).

Both run np barrier tasks (TorchDistributor with local_mode=False: one torchrun per
task).  Each is warmed up first (Python workers started, imports cached), then timed
`--reps` times, interleaved so a noisy neighbour hurts both alike.  Prints a table
(median, min, ratio = ours / theirs) and writes JSON to benchmarks/results/launch.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def ours_noop():
    return 0


def ours_bootstrap():
    import numpy as np
    import collectives
    comm = collectives.init()
    comm.allreduce(np.ones(1 << 18, dtype=np.float32))
    comm.close()
    return 0


def ours_torch():
    import torch

    import horovod_spark.torch as hvd
    hvd.init()
    hvd.allreduce(torch.ones(1 << 18, dtype=torch.float32))
    hvd.shutdown()
    return 0


def torch_noop():
    return 0


def torch_bootstrap():
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1 << 18, dtype=torch.float32))
    dist.destroy_process_group()
    return 0


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _timed_retrying(fn, failures: list, tries: int = 3) -> float:
    """TorchDistributor picks its rendezvous port, closes it, and torchrun binds it later: on a
    busy machine another process can take it first (EADDRINUSE).  Count, retry, go on."""
    for attempt in range(tries):
        try:
            return _timed(fn)
        except Exception as exc:
            failures.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            if attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def _session(master: str):
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (SparkSession.builder.master(master).appName("launch-benchmark")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.executorEnv.PYTHONPATH", os.path.dirname(HERE)).getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _connect_server(master: str):
    """A local Spark Connect server and a client session of it (see tests/connect_server.py)."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    from connect_server import ConnectServer

    server = ConnectServer(master)
    print(f"Spark Connect server up in {server.start_seconds:.1f} s", flush=True)
    server.session()
    return server


def _connect_mode(on: bool) -> None:
    """This process in the user's Connect mode (getActiveSession answers the Connect client)."""
    if on:
        os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"
    else:
        os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)


def _stop_python_workers() -> None:
    """Stop the Spark Python workers under this process (the classic session's and the
    Connect server's), as Spark stops workers idle for a minute: the next job's tasks run
    in fresh workers, as a job does that comes more than a minute after the last."""
    import psutil

    workers = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if "pyspark.daemon" in proc.cmdline() and "pyspark.daemon" in proc.parent().cmdline():
                workers.append(proc)
        except psutil.Error:
            pass
    for worker in workers:
        worker.kill()
    psutil.wait_procs(workers, timeout=10)


def measure(np_: int, reps: int, cases, connect: bool = False, fresh: bool = False) -> tuple:
    import cloudpickle
    from pyspark import cloudpickle as spark_cloudpickle
    from pyspark.ml.torch.distributor import TorchDistributor

    import horovod_spark
    from horovod_spark._job import Cluster

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    spark_cloudpickle.register_pickle_by_value(sys.modules[__name__])
    distributor = TorchDistributor(num_processes=np_, local_mode=False, use_gpu=False)
    if connect:
        _connect_mode(True)
        remote = TorchDistributor(num_processes=np_, local_mode=False, use_gpu=False)
        _connect_mode(False)
    runners = {
        "noop": (ours_noop, torch_noop),
        "bootstrap": (ours_bootstrap, torch_bootstrap),
        "torch": (ours_torch, torch_bootstrap),
    }
    variants = {"horovod_spark": {}, "hs dataframe stage": {"stage": "dataframe"},
                "hs no-warm": {"HOROVOD_SPARK_WARM_START": "0"},
                "hs allGather": {"HOROVOD_SPARK_WARM_START": "0",
                                 "HOROVOD_SPARK_RENDEZVOUS": "spark"}}
    if connect:
        variants["hs Connect"] = {"connect": "1"}

    def ours(fn, env):
        def run():
            settings = {k: v for k, v in env.items() if k.startswith("HOROVOD_")}
            saved = {k: os.environ.get(k) for k in settings}
            os.environ.update(settings)
            Cluster.classic_stage = env.get("stage", "rdd")
            _connect_mode("connect" in env)
            try:
                horovod_spark.run(fn, num_proc=np_)
            finally:
                _connect_mode(False)
                Cluster.classic_stage = "rdd"
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        return run

    out, failures = {}, []
    for case, (our_fn, their_fn) in runners.items():
        if case not in cases:
            continue
        theirs = {"TorchDistributor": lambda: distributor.run(their_fn)}  # noqa: E731
        if connect:
            def on_connect(fn=their_fn):
                _connect_mode(True)
                try:
                    return remote.run(fn)
                finally:
                    _connect_mode(False)
            theirs["TorchDistributor Connect"] = on_connect
        for env in variants.values():
            ours(our_fn, env)()  # warm up: Python workers, imports, zygotes
        for run in theirs.values():
            _timed_retrying(run, failures)
        times = {name: [] for name in [*variants, *theirs]}
        for _ in range(reps):
            for name, env in variants.items():
                if fresh:
                    _stop_python_workers()
                times[name].append(_timed(ours(our_fn, env)))
            for name, run in theirs.items():
                if fresh:
                    _stop_python_workers()
                times[name].append(_timed_retrying(run, failures))
        out[case] = times
    return out, failures


def report(results: dict) -> list:
    rows = []
    print(f"{'case':<10} {'runner':<24} {'median s':>9} {'min s':>7} {'ratio':>7} "
          f"{'vs classic':>10}   (ratio: median / TorchDistributor's on the same kind of "
          "session; vs classic: median / horovod_spark's on classic)")
    for case, times in results.items():
        ours_classic = statistics.median(times["horovod_spark"])
        for runner, ts in times.items():
            connect = "Connect" in runner
            base = statistics.median(times["TorchDistributor Connect" if connect
                                           else "TorchDistributor"])
            med = statistics.median(ts)
            ratio, vs = med / base, med / ours_classic
            rows.append({"case": case, "runner": runner, "median_s": med, "min_s": min(ts),
                         "ratio_vs_TorchDistributor": ratio, "ratio_vs_ours_classic": vs,
                         "times_s": ts})
            print(f"{case:<10} {runner:<24} {med:>9.3f} {min(ts):>7.3f} {ratio:>7.2f} "
                  f"{vs:>10.2f}")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--master", default="local[2]")
    p.add_argument("--cases", default="noop,bootstrap,torch",
                   help="comma-separated: noop, bootstrap, torch")
    p.add_argument("--fresh-workers", action="store_true",
                   help="stop Spark's Python workers before each timed run (as Spark does "
                        "after a minute idle): jobs more than a minute apart")
    p.add_argument("--connect", action="store_true",
                   help="also time ours and TorchDistributor on a local Spark Connect server")
    p.add_argument("--out", default=os.path.join(HERE, "results", "launch.json"))
    ns = p.parse_args()
    spark = _session(ns.master)  # first: a JVM launched after a gRPC client fails to start
    server = None
    try:
        server = _connect_server(ns.master) if ns.connect else None
        results, failures = measure(ns.np, ns.reps, ns.cases.split(","), ns.connect,
                                    ns.fresh_workers)
    finally:
        spark.stop()
        if server is not None:
            server.stop()
    rows = report(results)
    os.makedirs(os.path.dirname(ns.out), exist_ok=True)
    meta = {"np": ns.np, "reps": ns.reps, "master": ns.master, "connect": ns.connect,
            "fresh_workers": ns.fresh_workers, "python": platform.python_version(),
            "cpus": os.cpu_count(), "loadavg_after": os.getloadavg(),
            "note": "shared machine: other engineers' jobs run at the same time; numbers are noisy",
            "TorchDistributor_failed_runs_retried": failures}
    if failures:
        print(f"TorchDistributor failed {len(failures)} run(s), retried: {failures[0]}")
    with open(ns.out, "w") as f:
        json.dump({"benchmark": "launch", "meta": meta, "rows": rows}, f, indent=2)
    print(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
