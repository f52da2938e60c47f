"""The driver program the cluster tests run in the head host (one process, one Spark app).

argv: the app's layout as JSON (cores, executor_cores, conf).  It starts the
session, then runs one scenario per JSON line on its stdin ({"scenario",
"args"}) and prints one `RESULT {json}` line each; EOF stops the app.  The
training functions travel by value (cloudpickle), so the executors need
nothing of this file.
"""
import json
import os
import sys
import time
import traceback

import cloudpickle

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import horovod_spark  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

# elements: empty, one, odd, below and above chunk sizes, and (in float32: 8 MiB and a
# bit) a pipelined allreduce across hosts, the last of its hier_chunks short
COUNTS = (0, 1, 7, 1023, 1 << 18, (1 << 21) + 5)
FAST_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def session(cores_max: int, executor_cores: int, conf=()):
    from pyspark.sql import SparkSession

    b = (SparkSession.builder.master(os.environ["CLUSTER_TEST_MASTER"]).appName("hvs-cluster-test")
         .config("spark.driver.host", os.environ["CLUSTER_TEST_DRIVER_HOST"])
         .config("spark.driver.bindAddress", os.environ["CLUSTER_TEST_DRIVER_HOST"])
         .config("spark.cores.max", str(cores_max))
         .config("spark.executor.cores", str(executor_cores))
         .config("spark.executor.memory", "600m").config("spark.driver.memory", "600m")
         .config("spark.ui.enabled", "false")
         # short-lived JVMs on 2 shared cores: C1 only and a serial GC start them faster
         .config("spark.executor.extraJavaOptions", FAST_JVM)
         .config("spark.driver.extraJavaOptions", FAST_JVM)
         .config("spark.executorEnv.PYTHONPATH", ROOT)
         .config("spark.executorEnv.OMP_NUM_THREADS", "1")
         .config("spark.python.worker.reuse", "true"))
    for k, v in conf:
        b = b.config(k, v)
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _executors(spark) -> int:
    return spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() - 1


def wait_executors(spark, count: int, timeout: float = 120.0) -> None:
    """Until the app has `count` executors (a scenario may have killed one: the Master
    starts another)."""
    deadline = time.monotonic() + timeout
    while _executors(spark) != count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the app has {_executors(spark)} executors, not {count}, "
                               f"after {timeout} s")
        time.sleep(0.2)


def wait_listening(url: str, timeout: float = 240.0) -> None:
    """Until the Connect server at sc://localhost:PORT/... accepts connections."""
    import socket

    port = int(url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no Spark Connect server on port {port} after {timeout} s")
            time.sleep(0.5)


def inputs(rank: int, count: int, dtype):
    """Exact in every dtype: small integers, different on each rank."""
    import numpy as np

    return ((np.arange(count) * (rank + 3) + rank) % 61 - 30).astype(dtype)


def collectives_fn(counts, steps):
    """Placement, allreduce results, a few training steps: what the driver compares."""
    import hashlib
    import socket

    import torch

    import horovod_spark.torch as hvd

    hvd.init()
    r = hvd.rank()
    sums = {}
    for dtype in ("float32", "float64", "int32"):
        for c in counts:
            x = torch.from_numpy(inputs(r, c, dtype))
            y = hvd.allreduce(x, op=hvd.Sum, name=f"t.{dtype}.{c}")
            sums[f"{dtype}.{c}"] = hashlib.sha256(y.numpy().tobytes()).hexdigest()
    torch.manual_seed(1234 + r)  # different data per rank, same start after broadcast
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    for _ in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(16, 32)).square().mean()
        loss.backward()
        opt.step()
    weights = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                      for p in model.parameters())).hexdigest()
    out = {"rank": r, "size": hvd.size(), "local_rank": hvd.local_rank(),
           "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(),
           "cross_size": hvd.cross_size(), "hostname": socket.gethostname(),
           "addr": os.environ.get("HVS_BIND_ADDR"), "sums": sums, "weights": weights,
           "cma": hvd._state.communicator().backend.cma,
           "metrics": {k: v for k, v in hvd.metrics().items() if isinstance(v, (int, float))}}
    hvd.shutdown()
    return out


def expected_sums(size: int, counts) -> dict:
    import hashlib

    import numpy as np

    out = {}
    for dtype in ("float32", "float64", "int32"):
        for c in counts:
            total = sum(inputs(r, c, dtype) for r in range(size)) if c else np.zeros(0, dtype)
            out[f"{dtype}.{c}"] = hashlib.sha256(np.asarray(total, dtype).tobytes()).hexdigest()
    return out


def scenario_collectives(spark, a: dict) -> dict:
    """Each rendezvous mode asked for: every rank's account, and numpy's sums.  `driver_env`:
    the driver's own settings for these jobs (a Connect client's address)."""
    runs, seconds = {}, {}
    os.environ.update(a.get("driver_env", {}))
    for mode in a.get("modes", ("driver", "spark")):
        os.environ["HOROVOD_SPARK_RENDEZVOUS"] = mode
        started = time.monotonic()
        runs[mode] = horovod_spark.run(collectives_fn, args=(COUNTS, a.get("steps", 3)),
                                       num_proc=a["np"], env=a.get("env"), verbose=0)
        seconds[mode] = time.monotonic() - started
    for key in ("HOROVOD_SPARK_RENDEZVOUS", *a.get("driver_env", {})):
        os.environ.pop(key, None)
    return {"runs": runs, "expected": expected_sums(a["np"], COUNTS), "seconds": seconds}


def hang_fn(marker_dir, seconds):
    """Publish where this rank lives, then allreduce until killed from outside.  Numpy and
    the communicator only: no torch to import, and so no warm zygote is ever kept."""
    import numpy as np

    import collectives

    comm = collectives.init()
    with open(os.path.join(marker_dir, f"rank{comm.rank}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "host": os.environ.get("HVS_BIND_ADDR")}, f)
    x = np.ones(1 << 16, np.float32)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        comm.allreduce(x, out=x)
    return "finished"


def scenario_fault(spark, a: dict) -> dict:
    """A job the test breaks from outside: the driver's error, and how long it took."""
    started = time.monotonic()
    try:
        horovod_spark.run(hang_fn, args=(a["markers"], a["seconds"]), num_proc=a["np"],
                          env=a.get("env"), verbose=0)
        return {"error": None}
    except Exception as exc:  # the error under test
        return {"error": str(exc), "type": type(exc).__name__, "failed_at": time.monotonic(),
                "seconds": time.monotonic() - started}


def steady_fn(marker_dir, attacked, stop, seconds):
    """Allreduce exact inputs until `stop` appears: rounds, rounds after `attacked`
    appeared, and results that differ from numpy's."""
    import numpy as np

    import collectives

    comm = collectives.init()
    with open(os.path.join(marker_dir, f"rank{comm.rank}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "host": os.environ.get("HVS_BIND_ADDR")}, f)
    counts = (1, 1023, 1 << 18)
    want = {c: sum(inputs(r, c, "float32") for r in range(comm.size)) for c in counts}
    rounds = after = wrong = 0
    deadline = time.monotonic() + seconds
    while True:  # the ranks agree on when to stop: one MAX of everyone's "stop"
        done = np.array([os.path.exists(stop) or time.monotonic() > deadline], np.int32)
        if comm.allreduce(done, op=collectives.ReduceOp.MAX)[0]:
            break
        for c in counts:
            wrong += int(not np.array_equal(comm.allreduce(inputs(comm.rank, c, "float32")),
                                            want[c]))
        rounds += 1
        after += int(os.path.exists(attacked))
        if rounds % 50 == 0:
            print(f"rank {comm.rank}: {rounds} rounds", flush=True)  # the log channel's work
    return {"rank": comm.rank, "rounds": rounds, "after": after, "wrong": wrong,
            "stopped": os.path.exists(stop)}


def scenario_steady(spark, a: dict) -> dict:
    """A job that runs until the test says stop (see steady_fn): every rank's account."""
    started = time.monotonic()
    ranks = horovod_spark.run(steady_fn, args=(a["markers"], a["attacked"], a["stop"],
                                               a["seconds"]),
                              num_proc=a["np"], env=a.get("env"), verbose=0)
    return {"ranks": ranks, "seconds": time.monotonic() - started}


def scenario_estimator(spark, a: dict) -> dict:
    """TorchEstimator fit, transform, save and load with a shared Store; then a fit that
    names a run_id with a Store on each host's own /tmp: refused before training."""
    import numpy as np
    import torch

    from horovod_spark.estimator import Store, TorchEstimator, TorchModel

    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 8))
    rows = [(x_.tolist(), float(x_.sum() > 0)) for x_ in x]
    df = spark.createDataFrame(rows, ["features", "label"])
    torch.manual_seed(0)

    def estimator(store, run_id=None):
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        return TorchEstimator(num_proc=a["np"], model=net, loss=torch.nn.BCEWithLogitsLoss(),
                              optimizer=torch.optim.Adam(net.parameters(), lr=0.02),
                              feature_cols=["features"], label_cols=["label"], batch_size=32,
                              epochs=3, store=store, run_id=run_id, verbose=0)

    model = estimator(Store.create(a["shared"])).fit(df)
    out = model.transform(df).select("label", "label__output").collect()
    path = os.path.join(a["shared"], "saved-model")
    model.write().overwrite().save(path)
    again = TorchModel.load(path).transform(df).select("label__output").collect()
    same = [r.label__output for r in out] == [r.label__output for r in again]
    try:
        estimator(Store.create("/tmp/hvs-host-local-store"), run_id="resumable").fit(df)
        refused = None
    except Exception as exc:  # the error under test
        refused = str(exc)
    return {"rows": len(out), "history": model.getHistory(), "reloaded_same": same,
            "refused": refused}


def _ddp_model_and_batch(rank: int, step: int):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 8, generator=g)
    return model, (x, x[:, :2] * 2.0 - 1.0)


def ddp_fn(steps: int, backend: str = "gloo") -> dict:
    """DistributedDataParallel as its tutorial writes it (env://) over `backend`; every rank's
    placement and weights."""
    import torch
    import torch.distributed as dist

    dist.init_process_group(backend)
    rank = dist.get_rank()
    model = torch.nn.parallel.DistributedDataParallel(_ddp_model_and_batch(0, 0)[0])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = _ddp_model_and_batch(rank, step)[1]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    env = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR",
                                      "HVS_BIND_ADDR")}
    mine = {"env": env, "weights": [v.flatten().tolist() for v in model.module.parameters()]}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    dist.destroy_process_group()
    return everyone


def ddp_expected(world: int, steps: int) -> list:
    """What DDP over `world` ranks ends with: one process, the mean of every rank's loss."""
    import torch

    model = _ddp_model_and_batch(0, 0)[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        losses = [torch.nn.functional.mse_loss(model(x), y)
                  for x, y in (_ddp_model_and_batch(r, step)[1] for r in range(world))]
        opt.zero_grad()
        (sum(losses) / world).backward()
        opt.step()
    return [v.flatten().tolist() for v in model.parameters()]


def scenario_torchdist(spark, a: dict) -> dict:
    """A DDP function through horovod_spark.TorchDistributor, every rank's account."""
    from horovod_spark import TorchDistributor

    ranks = TorchDistributor(num_processes=a["np"], local_mode=False, use_gpu=False,
                             verbose=0).run(ddp_fn, a.get("steps", 3), a.get("backend", "gloo"))
    return {"ranks": ranks, "expected": ddp_expected(a["np"], a.get("steps", 3))}


SCENARIOS = {"collectives": scenario_collectives, "fault": scenario_fault,
             "estimator": scenario_estimator, "steady": scenario_steady,
             "torchdist": scenario_torchdist}


def serve(layout: dict) -> None:
    """The session, then one scenario a line of stdin until EOF; then the app stops."""
    started = time.monotonic()
    if "remote" in layout:  # a Spark Connect client: the run waits for the server's slots
        from pyspark.sql import SparkSession

        wait_listening(layout["remote"])
        spark, executors = SparkSession.builder.remote(layout["remote"]).getOrCreate(), None
    else:
        spark = session(layout["cores"], layout["executor_cores"], layout.get("conf", ()))
        executors = layout["cores"] // layout["executor_cores"]
        wait_executors(spark, executors)
    print(f"session up in {time.monotonic() - started:.1f} s", flush=True)
    try:
        for line in sys.stdin:
            request = json.loads(line)
            try:
                if executors:
                    wait_executors(spark, executors)
                started = time.monotonic()
                result = SCENARIOS[request["scenario"]](spark, request["args"])
                result["scenario_seconds"] = time.monotonic() - started
            except Exception:  # the test shows it; the app serves the next scenario
                result = {"exception": traceback.format_exc()}
            print("RESULT " + json.dumps(result), flush=True)
    finally:
        spark.stop()  # free the app's cores


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]))
