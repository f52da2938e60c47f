"""Keras 3 training: scaling efficiency of horovod_spark.keras vs tf.distribute's MWMS.

    python benchmarks/training_keras.py                  # the CNN, batch 32, 2 ranks
    python benchmarks/training_keras.py --model mlp --batch 64 --rounds 3
    python benchmarks/training_keras.py --pin --overhead        # cost per step, one launch

Models: `cnn` is the small CNN of benchmarks/training.py (3x32x32 inputs, two
conv+pool blocks, 64-unit dense; 0.3 MB of gradients); `mlp` is 784-512-512-10
(2.7 MB of gradients for little compute: the communication-heavy case).

Weak scaling: every process trains on a local batch of B samples with one
intra-op and one inter-op thread (TF_NUM_INTRAOP_THREADS=1, ..._INTEROP_...=1),
so N processes do N times the work of one.  *Throughput* is samples per second
over the measured steps (after warmup) of the slowest process; *efficiency* =
throughput of N processes / (N x throughput of one process in the same style).

Sides (each in its own fresh processes, started by collectives.launch.run_local):
  single-fit   1 process, plain Keras model.fit, batch B
  single-loop  1 process, a tf.function step: GradientTape + optimizer.apply_gradients
  ours-fit     N ranks, model.fit with hvd.DistributedOptimizer + BroadcastGlobalVariablesCallback
  ours-loop    N ranks, the single-loop step with hvd.DistributedGradientTape
  mwms-loop    N workers of tf.distribute.MultiWorkerMirroredStrategy (TF_CONFIG on
               localhost ports, gRPC collectives), the single-loop step under strategy.run
  indep-fit    N processes of single-fit at once, no communication at all: what N
  indep-loop   processes get from this machine (shared caches, memory bandwidth,
               hypervisor); ours / indep is the cost of the communication alone
  mwms-fit     N MWMS workers with model.fit: tried once; on Keras 3 it fails in fit's
               symbolic build (keras-team/keras#20585), and the error is recorded
--overhead measures instead what a step of ours costs over a plain step *within one
launch* (launch-to-launch drift on a shared VM is often 30%, far more than the cost):
each process builds one model and three tf.function steps -- plain, `hvd` (the
DistributedGradientTape step as it runs: the native op and the engine's lane) and `hvd`
traced with HOROVOD_SPARK_TF_LANE=0 (the tf.numpy_function path) -- and times blocks of
--steps steps of each in turn (the order alternates), in a world of one and of N.  The
table gives the median per-step time of each and the median, over blocks, of each hvd
step's excess over the plain block next to it.
With --pin every process is held to one core of its own (rank r on core r,
the single process on core 0), its helper threads (tf.data's prefetch, the
engine's) included; without it the single process's helpers run on the
idle cores, an advantage the N processes, which fill every core, lack.
Sides take turns round by round so machine noise hits all alike; each launch
measures `--windows` windows of `--steps` steps.  The table shows the best
window (the least disturbed by other load) and the median, and the median CPU
time per step per process (all its threads): CPU time is far less disturbed
by other load than wall time, and on a quiet machine with a core per process
it bounds the step time.  The JSON keeps every window and the load average.
The targets: ours >= 0.9 efficiency and not below the peer.  Results go to
benchmarks/results/training_keras-*.json.  On a shared machine the numbers are noisy.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, REPO)

RANK_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_NUM_INTRAOP_THREADS": "1",
            "TF_NUM_INTEROP_THREADS": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
            "PYTHONWARNINGS": "ignore"}


# -- what every process runs ---------------------------------------------------
def _model(keras, kind: str):
    L = keras.layers
    if kind == "mlp":
        layers = [keras.Input((784,)), L.Dense(512, activation="relu"),
                  L.Dense(512, activation="relu"), L.Dense(10)]
    else:
        layers = [keras.Input((32, 32, 3)), L.Conv2D(16, 3, activation="relu"), L.MaxPooling2D(),
                  L.Conv2D(32, 3, activation="relu"), L.MaxPooling2D(), L.Flatten(),
                  L.Dense(64, activation="relu"), L.Dense(10)]
    keras.utils.set_random_seed(0)
    return keras.Sequential(layers)


def _dataset(tf, kind: str, batch: int):
    import numpy as np

    rng = np.random.default_rng(0)
    shape = (784,) if kind == "mlp" else (32, 32, 3)
    x = rng.random((16 * batch,) + shape, dtype=np.float32)
    y = rng.integers(0, 10, 16 * batch)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch, drop_remainder=True)
    opts = tf.data.Options()
    opts.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return ds.prefetch(2).with_options(opts)


def _stamp() -> tuple:
    """(wall clock, CPU seconds of this whole process: every thread, user and system)."""
    return time.perf_counter(), time.process_time()


def _windows(stamps, cfg) -> list:
    """(wall s, CPU s) of each measured window of cfg['steps'] steps, after the warmup."""
    w, s = cfg["warmup"], cfg["steps"]
    out = []
    for k in range(cfg["windows"]):
        (t0, c0), (t1, c1) = stamps[w - 1 + k * s], stamps[w - 1 + (k + 1) * s]
        out.append((t1 - t0, c1 - c0))
    return out


def _total_steps(cfg) -> int:
    return cfg["warmup"] + cfg["steps"] * cfg["windows"]


def _loss(keras, reduction="sum_over_batch_size"):
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)


def _fit(cfg, distributed: bool) -> list:
    import keras
    import tensorflow as tf

    stamps = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            stamps.append(_stamp())

    model, opt, callbacks = _model(keras, cfg["model"]), keras.optimizers.SGD(0.01), [Clock()]
    if distributed:
        import horovod_spark.keras as hvd

        hvd.init()
        opt = hvd.DistributedOptimizer(opt)
        callbacks.insert(0, hvd.callbacks.BroadcastGlobalVariablesCallback(0))
    model.compile(optimizer=opt, loss=_loss(keras), jit_compile=False)
    model.fit(_dataset(tf, cfg["model"], cfg["batch"]), steps_per_epoch=_total_steps(cfg), epochs=1,
              verbose=0, callbacks=callbacks)
    return _windows(stamps, cfg)


def _loop_step(tf, model, opt, loss_fn, distributed: bool):
    """The custom loop's training step, a tf.function (DistributedGradientTape if distributed)."""
    if distributed:
        import horovod_spark.tensorflow as hvd

    @tf.function(autograph=False)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        if distributed:
            tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


def _loop(cfg, distributed: bool) -> list:
    import keras
    import tensorflow as tf

    model, opt, loss_fn = _model(keras, cfg["model"]), keras.optimizers.SGD(0.01), _loss(keras)
    opt.build(model.trainable_variables)
    if distributed:
        import horovod_spark.tensorflow as hvd

        hvd.init()
        hvd.broadcast_variables(model.variables, 0)

    step = _loop_step(tf, model, opt, loss_fn, distributed)
    stamps = []
    it = iter(_dataset(tf, cfg["model"], cfg["batch"]))
    for _ in range(_total_steps(cfg)):
        step(*next(it)).numpy()
        stamps.append(_stamp())
    return _windows(stamps, cfg)


def _mwms(cfg, ports, use_fit: bool) -> list:
    rank = int(os.environ["HVS_RANK"])
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                          "task": {"type": "worker", "index": rank}})
    import keras
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    global_batch = cfg["batch"] * len(ports)
    with strategy.scope():
        model, opt = _model(keras, cfg["model"]), keras.optimizers.SGD(0.01)
        opt.build(model.trainable_variables)
    ds = _dataset(tf, cfg["model"], global_batch)  # rebatched: B per worker
    if use_fit:
        model.compile(optimizer=opt, loss=_loss(keras), jit_compile=False)
        model.fit(ds, steps_per_epoch=_total_steps(cfg), epochs=1, verbose=0)
        return []
    loss_fn = _loss(keras, "none")

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_fn(y, model(x, training=True)),
                                              global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function(autograph=False)
    def step(it):
        x, y = next(it)
        return strategy.reduce("SUM", strategy.run(replica_step, (x, y)), axis=None)

    stamps, it = [], iter(strategy.experimental_distribute_dataset(ds))
    for _ in range(_total_steps(cfg)):
        step(it).numpy()
        stamps.append(_stamp())
    return _windows(stamps, cfg)


def _overhead(cfg) -> dict:
    """Per-block seconds per step of the plain, hvd (native op) and hvd-numpy steps."""
    import keras
    import tensorflow as tf

    import horovod_spark.tensorflow as hvd
    from horovod_spark.tensorflow import _basics

    hvd.init()
    model, opt, loss_fn = _model(keras, cfg["model"]), keras.optimizers.SGD(0.01), _loss(keras)
    opt.build(model.trainable_variables)
    hvd.broadcast_variables(model.variables, 0)

    it = iter(_dataset(tf, cfg["model"], cfg["batch"]).repeat())
    steps = {side: _loop_step(tf, model, opt, loss_fn, side != "plain")
             for side in ("plain", "hvd", "hvd-numpy")}
    for side, fn in steps.items():  # trace (hvd-numpy with the native op off) and warm up
        if side == "hvd-numpy":
            os.environ["HOROVOD_SPARK_TF_LANE"] = "0"
        try:
            for _ in range(cfg["warmup"]):
                fn(*next(it)).numpy()
        finally:
            os.environ.pop("HOROVOD_SPARK_TF_LANE", None)
    times = {side: [] for side in steps}
    order = list(steps)
    for block in range(cfg["windows"]):
        for side in (order if block % 2 == 0 else order[::-1]):
            hvd.barrier()  # every rank starts the block together
            t0 = time.perf_counter()
            for _ in range(cfg["steps"]):
                steps[side](*next(it)).numpy()
            times[side].append((time.perf_counter() - t0) / cfg["steps"])
    times["lane_cycles"] = _basics.engine().metrics()["lane_cycles"]
    return times


def _overhead_table(args, runs: dict) -> str:
    """runs: {world size: [per-rank times of every launch]}."""
    lines = [f"Keras {args.model}, local batch {args.batch}: per-step time within one launch "
             f"({'pinned, ' if args.pin else ''}{args.windows} blocks of {args.steps} steps per "
             "launch, rank 0)",
             f"{'world':>5} {'plain ms':>9} {'hvd ms':>8} {'numpy ms':>9} {'hvd-plain ms':>13} "
             f"{'numpy-plain ms':>15}  (median over blocks, p25..p75)"]

    def q(v, f):
        v = sorted(v)
        return v[min(len(v) - 1, int(f * len(v)))]

    for n, launches in sorted(runs.items()):
        plain, hvd_, num, d_h, d_n = [], [], [], [], []
        for per_rank in launches:
            t = per_rank[0]
            plain += t["plain"]
            hvd_ += t["hvd"]
            num += t["hvd-numpy"]
            d_h += [b - a for a, b in zip(t["plain"], t["hvd"])]
            d_n += [b - a for a, b in zip(t["plain"], t["hvd-numpy"])]
        ms = lambda v: f"{1e3 * statistics.median(v):.3f}"  # noqa: E731
        rng = lambda v: f"{1e3 * statistics.median(v):+.3f} ({1e3 * q(v, .25):+.2f}..{1e3 * q(v, .75):+.2f})"  # noqa: E731
        lines.append(f"{n:>5} {ms(plain):>9} {ms(hvd_):>8} {ms(num):>9} {rng(d_h):>13} {rng(d_n):>15}")
    return "\n".join(lines)


def _pin(cfg) -> None:
    """With --pin, each process runs on one core of its own (rank r on core r), every thread
    of it (TensorFlow's, tf.data's, the engine's) included: set before TensorFlow starts any."""
    if cfg.get("pin"):
        cores = sorted(os.sched_getaffinity(0))
        core = {cores[int(os.environ.get("HVS_RANK", "0")) % len(cores)]}
        for tid in os.listdir("/proc/self/task"):  # (affinity is per thread; new ones inherit it)
            os.sched_setaffinity(int(tid), core)


def _side_body(side: str, cfg: dict, ports=None) -> list:
    _pin(cfg)
    if side == "overhead":
        return _overhead(cfg)
    if side in ("single-fit", "ours-fit", "indep-fit"):
        return _fit(cfg, side == "ours-fit")
    if side in ("single-loop", "ours-loop", "indep-loop"):
        return _loop(cfg, side == "ours-loop")
    return _mwms(cfg, ports, side == "mwms-fit")


# -- the driver --------------------------------------------------------------
def _free_ports(n: int) -> list:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _run_side(side: str, cfg: dict, np_: int) -> dict:
    """Throughputs (samples/s) of each window, or the error that stopped the side."""
    from collectives.launch import RankFailed, run_local

    n = 1 if side.startswith("single") else np_
    ports = _free_ports(n) if side.startswith("mwms") else None
    try:
        per_rank = run_local(_side_body, n, args=(side, cfg, ports), env=RANK_ENV,
                             timeout=cfg["timeout"], prefix_output=True)
    except RankFailed as exc:
        return {"error": str(exc).strip().splitlines()[0][:300], "detail": str(exc)[-2000:]}
    windows = list(zip(*per_rank))  # per window: every rank's (wall, cpu)
    return {"samples_per_s": [n * cfg["batch"] * cfg["steps"] / max(w for w, _ in ws) for ws in windows],
            "cpu_ms_per_step": [1e3 * sum(c for _, c in ws) / n / cfg["steps"] for ws in windows]}


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=2, help="processes of the distributed sides (2)")
    p.add_argument("--model", choices=("cnn", "mlp"), default="cnn")
    p.add_argument("--batch", type=int, default=32, help="local batch per process (32)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--steps", type=int, default=40, help="steps per measured window (40)")
    p.add_argument("--windows", type=int, default=3, help="measured windows per launch (3)")
    p.add_argument("--rounds", type=int, default=2, help="launches per side (2)")
    p.add_argument("--sides", default="single-fit,single-loop,ours-fit,ours-loop,mwms-loop,mwms-fit")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    p.add_argument("--pin", action="store_true",
                   help="one core per process (rank r on core r; the single process on core 0), "
                        "so one process and each of N get the same CPU")
    p.add_argument("--overhead", action="store_true",
                   help="measure the per-step cost of ours within one launch (see above)")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def _measure(args) -> dict:
    cfg = {k: getattr(args, k) for k in ("model", "batch", "warmup", "steps", "windows", "timeout",
                                         "pin")}
    sides = args.sides.split(",")
    samples = {s: [] for s in sides}
    cpu = {s: [] for s in sides}
    errors = {}
    for rnd in range(args.rounds):
        for side in sides:
            if side in errors or (side == "mwms-fit" and rnd > 0):
                continue
            print(f"round {rnd + 1}/{args.rounds}: {side} ...", flush=True)
            res = _run_side(side, cfg, args.np)
            if "error" in res:
                errors[side] = res
                print(f"  {side} failed: {res['error']}", flush=True)
                continue
            samples[side] += res["samples_per_s"]
            cpu[side] += res["cpu_ms_per_step"]
            print("  " + ", ".join(f"{v:.0f}" for v in res["samples_per_s"]) + " samples/s; "
                  + ", ".join(f"{v:.1f}" for v in res["cpu_ms_per_step"]) + " CPU ms/step", flush=True)
    return {"samples": samples, "cpu_ms_per_step": cpu, "errors": errors}


def _table(args, result: dict) -> str:
    stats = {s: (max(v), statistics.median(v)) for s, v in result["samples"].items() if v}
    lines = [f"Keras {args.model}, local batch {args.batch}, {args.np} processes x 1 thread "
             f"{'pinned, one core each ' if args.pin else ''}(weak scaling; shared, noisy CPU)",
             f"{'side':<12} {'procs':>5} {'best/s':>8} {'median/s':>8} {'eff best':>8} "
             f"{'eff med':>8} {'cpu ms':>7}  baseline"]
    for side in result["samples"]:
        procs = 1 if side.startswith("single") else args.np
        if side in result["errors"]:
            lines.append(f"{side:<12} {procs:>5} {'-':>8} {'-':>8} {'-':>8} {'-':>8} {'-':>7}  "
                         f"failed: {result['errors'][side]['error']}")
            continue
        if side not in stats:
            continue
        style = "fit" if side.endswith("fit") else "loop"
        ref = stats.get(f"single-{style}")
        eff = [v / (procs * r) if ref and procs > 1 else 1.0 for v, r in zip(stats[side], ref or (1, 1))]
        cpu = statistics.median(result["cpu_ms_per_step"][side])
        lines.append(f"{side:<12} {procs:>5} {stats[side][0]:>8.0f} {stats[side][1]:>8.0f} "
                     f"{eff[0]:>8.3f} {eff[1]:>8.3f} {cpu:>7.1f}  single-{style}")
    for style in ("fit", "loop"):
        if f"ours-{style}" in stats and f"indep-{style}" in stats:
            best, med = (a / b for a, b in zip(stats[f"ours-{style}"], stats[f"indep-{style}"]))
            lines.append(f"ours-{style} / indep-{style} throughput (the communication's cost): "
                         f"best {best:.3f}, median {med:.3f}")
    if "ours-loop" in stats and "mwms-loop" in stats:
        best, med = (a / b for a, b in zip(stats["ours-loop"], stats["mwms-loop"]))
        lines.append(f"ours-loop / mwms-loop throughput: best {best:.3f}, median {med:.3f}")
    return "\n".join(lines)


def _measure_overhead(args) -> dict:
    from collectives.launch import run_local

    cfg = {k: getattr(args, k) for k in ("model", "batch", "warmup", "steps", "windows", "timeout",
                                         "pin")}
    cfg["windows"] = max(cfg["windows"], 10)
    runs: dict = {1: [], args.np: []}
    for rnd in range(args.rounds):
        for n in runs:
            print(f"round {rnd + 1}/{args.rounds}: overhead, {n} process(es) ...", flush=True)
            runs[n].append(run_local(_side_body, n, args=("overhead", cfg), env=RANK_ENV,
                                     timeout=cfg["timeout"], prefix_output=True))
    return runs


def main(argv=None) -> int:
    args = _args(argv)
    if args.overhead:
        result = _measure_overhead(args)
        table = _overhead_table(args, result)
    else:
        result = _measure(args)
        table = _table(args, result)
    print(table)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = args.json or os.path.join(REPO, "benchmarks", "results",
                                     f"training_keras{'-overhead' if args.overhead else ''}-"
                                     f"{args.model}-np{args.np}-{stamp}.json")
    with open(path, "w") as f:
        json.dump({"args": vars(args), "result": result, "table": table,
                   "host_cpus": os.cpu_count(), "load_avg": os.getloadavg()}, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
