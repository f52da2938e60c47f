"""A DDP function under pyspark's TorchDistributor and under horovod_spark's, side by side.

    python benchmarks/torch_distributed.py [--np 2] [--reps 5] [--master local[2]]
                                           [--frameworks] [--cluster]

The same function (DDP on a small MLP, 20 steps, init_process_group("gloo") from env://)
runs under both, local_mode=False (one Spark barrier task per rank), on one session, warmed
up once each, then `--reps` times interleaved.  Each run is timed on the driver from run()
to the first optimizer step of rank 0 (the function notes the wall clock then) and to the
return value.  `--frameworks` also runs DDP, FSDP2, Lightning, Hugging Face's Trainer and
accelerate once under each and says which ran.  `--cluster` runs the comparison with
`--np` ranks on two hosts of the emulated cluster (tests/cluster: network namespaces, a
Spark standalone Master and two Workers; needs root), the driver in the head host.
Prints a table (median, min, ratio = ours / theirs) and writes JSON under benchmarks/results.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]

from _table import write_json  # noqa: E402

STEPS = 20


def ddp_job(notes: str, steps: int = STEPS) -> int:
    """DDP as its tutorial writes it; rank 0 notes the wall clock of its first step."""
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                    torch.nn.Linear(256, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        x = torch.randn(32, 64)
        loss = torch.nn.functional.cross_entropy(model(x), torch.randint(0, 10, (32,)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 0 and rank == 0:
            with open(os.path.join(notes, "first"), "w") as f:
                f.write(repr(time.time()))
    dist.destroy_process_group()
    return rank


def _timed(run, notes: str) -> dict:
    first = os.path.join(notes, "first")
    if os.path.exists(first):
        os.unlink(first)
    t0 = time.time()
    run()
    end = time.time()
    with open(first) as f:
        return {"first_step": float(f.read()) - t0, "total": end - t0}


def compare(np_: int, reps: int, notes: str) -> dict:
    """Both distributors on the active session, interleaved: {name: [{first_step, total}]}."""
    from pyspark.ml.torch.distributor import TorchDistributor as Pyspark

    from horovod_spark import TorchDistributor

    ours = TorchDistributor(num_processes=np_, local_mode=False, use_gpu=False, verbose=0)
    theirs = Pyspark(num_processes=np_, local_mode=False, use_gpu=False)
    runners = {"horovod_spark": lambda: ours.run(ddp_job, notes),
               "pyspark": lambda: theirs.run(ddp_job, notes)}
    times = {name: [] for name in runners}
    for run in runners.values():  # warm up: Python workers, imports, zygotes
        _timed(run, notes)
    for _ in range(reps):
        for name, run in runners.items():
            times[name].append(_timed(run, notes))
    return times


def frameworks(np_: int, scratch: str) -> dict:
    """Which of the frameworks run under each distributor: {framework: {name: 'ok' or why}}."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "torchdist"))
    import _torchdist_programs as programs

    _register(programs.__name__)  # pyspark's cloudpickle too: executors cannot import it
    from pyspark.ml.torch.distributor import TorchDistributor as Pyspark

    from horovod_spark import TorchDistributor

    jobs = {"DDP": (programs.ddp_steps, ()), "FSDP2": (programs.fsdp2_steps, ()),
            "Lightning Trainer": (programs.lightning_fit, ("lightning",)),
            "Hugging Face Trainer": (programs.hf_train, ("hf",)),
            "accelerate": (programs.accelerate_loop, ())}
    out = {}
    for name, (fn, args) in jobs.items():
        out[name] = {}
        for who, cls in (("horovod_spark", TorchDistributor), ("pyspark", Pyspark)):
            where = tempfile.mkdtemp(dir=scratch)
            kwargs = {"verbose": 0} if cls is TorchDistributor else {}
            try:
                cls(num_processes=np_, local_mode=False, use_gpu=False, **kwargs).run(
                    fn, *[os.path.join(where, a) for a in args])
                out[name][who] = "ok"
            except Exception as exc:
                out[name][who] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return out


def _register(module_name: str) -> None:
    import cloudpickle
    from pyspark import cloudpickle as spark_cloudpickle

    for pickler in (cloudpickle, spark_cloudpickle):
        pickler.register_pickle_by_value(sys.modules[module_name])


def report(times: dict, where: str) -> list:
    rows = []
    print(f"\n# DDP ({STEPS} steps), {where}: seconds from run() (median, min of the runs)")
    print(f"{'':>14} {'first step':>22} {'return value':>22}")
    base = times["pyspark"]
    for name, runs in times.items():
        cells, row = [], {"runner": name}
        for key in ("first_step", "total"):
            values = [r[key] for r in runs]
            med, theirs = statistics.median(values), statistics.median(r[key] for r in base)
            row.update({f"{key}_median": med, f"{key}_min": min(values),
                        f"{key}_ratio": med / theirs})
            cells.append(f"{med:6.2f} {min(values):6.2f} {med / theirs:6.3f}x")
        print(f"{name:>14} {cells[0]:>22} {cells[1]:>22}")
        rows.append(row)
    return rows


def _local(args) -> dict:
    import pyspark
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_HOME", os.path.dirname(pyspark.__file__))
    spark = (SparkSession.builder.master(args.master).appName("torch-distributed-benchmark")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.executorEnv.PYTHONPATH", ROOT).getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    _register(__name__)
    scratch = tempfile.mkdtemp(prefix="hvs-bench-td-")
    try:
        out = {"where": f"{args.np} ranks on {args.master}",
               "times": compare(args.np, args.reps, scratch)}
        if args.frameworks:
            out["frameworks"] = frameworks(args.np, scratch)
        return out
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        spark.stop()


def _driver(layout: str) -> None:
    """The driver program in the emulated cluster's head host: one RESULT line."""
    from tests.cluster._program import session, wait_executors

    spec = json.loads(layout)
    spark = session(spec["cores"], spec["executor_cores"])
    wait_executors(spark, spec["cores"] // spec["executor_cores"])
    _register(__name__)
    try:
        times = compare(spec["np"], spec["reps"], spec["notes"])
        print("RESULT " + json.dumps(times), flush=True)
    finally:
        spark.stop()


def _cluster(args) -> dict:
    sys.path.insert(0, os.path.join(ROOT, "tests", "cluster"))  # _standalone imports _hosts so
    from _hosts import Netns, unavailable
    from _standalone import Standalone

    why = unavailable()
    if why:
        sys.exit(f"the emulated cluster is unavailable: {why}")
    workdir = tempfile.mkdtemp(prefix="hvs-bench-td-", dir="/var/tmp")
    logs, notes = os.path.join(workdir, "logs"), os.path.join(workdir, "notes")
    os.makedirs(logs)
    os.makedirs(notes)
    netns = Netns(workdir)
    try:
        head = netns.add_host("head")
        spark = Standalone(netns, head, logs)
        spark.add_workers([netns.add_host(name).box for name in ("h1", "h2")], 2)
        per_host = args.np // 2
        layout = json.dumps({"cores": 2 * per_host, "executor_cores": per_host, "np": args.np,
                             "reps": args.reps, "notes": notes})
        log = os.path.join(logs, "driver.log")
        proc = head.box.spawn([sys.executable, os.path.abspath(__file__), "--driver", layout],
                              spark.driver_env(), log)
        proc.wait(timeout=1800)
        with open(log, errors="replace") as f:
            text = f.read()
        lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
        if not lines:
            sys.exit(f"the driver program gave no result; its log ends:\n{text[-4000:]}")
        return {"where": f"{args.np} ranks on 2 emulated hosts (standalone)",
                "times": json.loads(lines[-1][len("RESULT "):])}
    finally:
        left = netns.close()
        shutil.rmtree(workdir, ignore_errors=True)
        if left:
            print(f"# teardown left {left}", file=sys.stderr)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--master", default="local[2]")
    p.add_argument("--frameworks", action="store_true", help="which frameworks run under each")
    p.add_argument("--cluster", action="store_true", help="on 2 hosts of the emulated cluster")
    p.add_argument("--driver", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.driver:
        return _driver(args.driver)
    result = _cluster(args) if args.cluster else _local(args)
    result["rows"] = report(result["times"], result["where"])
    for name, verdicts in result.get("frameworks", {}).items():
        print(f"{name:>22}: " + ", ".join(f"{who} {v}" for who, v in verdicts.items()))
    path = write_json("torch_distributed" + ("-cluster" if args.cluster else ""),
                      {"args": vars(args), **result})
    print(f"# wrote {path}")


if __name__ == "__main__":
    main()
