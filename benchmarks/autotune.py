"""HOROVOD_AUTOTUNE against fixed settings, on two workloads that want different ones.

    python benchmarks/autotune.py [--np 2] [--rounds 2] [--steps 30]

Workloads (numpy tensors through the fusion engine on `--np` local ranks, a step being
every tensor submitted, then every handle waited on):

  small   200 tensors of 16 KiB a step: fusion packs them into few allreduces, so a large
          threshold wants to win
  large   4 tensors of 8 MiB a step: each reduced where it lies needs no copy into and out
          of a fusion buffer, so a small threshold wants to win

For each workload, every fixed setting of the grid (fusion threshold x cycle time) runs
`--steps` timed steps after 5 untimed; `autotune` runs with HOROVOD_AUTOTUNE=1 and
Horovod's defaults (3 warm-up samples, 10 steps a sample, 20 samples) until tuning ends,
then the same timed steps at the setting it kept.  Each timed phase is the slowest
rank's; every configuration runs once per round, the rounds interleaved, and the table
shows each one's median over the rounds in steps/s, with autotune's against the best
fixed setting.  Writes JSON to benchmarks/results/.
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

WORKLOADS = {"small": (200, 16 * 1024), "large": (4, 8 * 1024 * 1024)}
THRESHOLDS_MIB = (0, 1, 16, 64)
CYCLES_MS = (0.5, 5.0)


def _rank(workload: str, steps: int, tune: bool) -> dict:
    import numpy as np

    import collectives
    from collectives.fusion.engine import FusionEngine

    count, nbytes = WORKLOADS[workload]
    comm = collectives.init()
    eng = FusionEngine(comm)
    xs = [np.ones(nbytes // 4, np.float32) for _ in range(count)]

    def step():
        for h in [eng.submit(f"{workload}.{i}", "allreduce", x, out=x)
                  for i, x in enumerate(xs)]:
            h.wait(120)

    def barrier():
        eng.submit("bench.sync", "barrier").wait(120)

    try:
        tuning_steps = 0
        if tune:
            while True:  # every rank sees tuning end at the same cycle; agree on it
                step()
                tuning_steps += 1
                flag = eng.submit("bench.tuning", "allreduce",
                                  np.array([1.0 if eng._tuner.active else 0.0])).wait(120)
                if flag[0] == 0.0 or tuning_steps > 2000:
                    break
        for _ in range(5):
            step()
        barrier()
        began = time.perf_counter()
        for _ in range(steps):
            step()
        barrier()
        took = time.perf_counter() - began
        kept = eng._tuner.point if tune else None
        return {"s": took, "tuning_steps": tuning_steps, "kept": kept}
    finally:
        eng.shutdown()
        comm.close()


def measure(np_: int, workload: str, steps: int, setting) -> dict:
    from collectives.launch import run_local

    env = {"HOROVOD_SPARK_TORCH_LANE": "0"}
    if setting == "autotune":
        env["HOROVOD_AUTOTUNE"] = "1"
    else:
        mib, ms = setting
        env.update(HOROVOD_FUSION_THRESHOLD=str(int(mib * (1 << 20))), HOROVOD_CYCLE_TIME=str(ms))
    res = run_local(_rank, np_, args=(workload, steps, setting == "autotune"), env=env,
                    timeout=900)
    slowest = max(r["s"] for r in res)
    return {"steps_per_s": steps / slowest, "tuning_steps": res[0]["tuning_steps"],
            "kept": res[0]["kept"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--workloads", default="small,large")
    args = ap.parse_args()
    settings = [(t, c) for t in THRESHOLDS_MIB for c in CYCLES_MS] + ["autotune"]
    runs: dict = {}
    for _ in range(args.rounds):
        for workload in args.workloads.split(","):
            for setting in settings:
                key = (workload, str(setting))
                runs.setdefault(key, []).append(measure(args.np, workload, args.steps, setting))
                print(workload, setting, runs[key][-1], flush=True)
    table = []
    for workload in args.workloads.split(","):
        rows = []
        for setting in settings:
            got = runs[(workload, str(setting))]
            rate = statistics.median(g["steps_per_s"] for g in got)
            rows.append((setting, rate, got))
        fixed = [r for r in rows if r[0] != "autotune"]
        best = max(fixed, key=lambda r: r[1])
        auto = next(r for r in rows if r[0] == "autotune")
        print(f"\n{workload}: {WORKLOADS[workload][0]} x {WORKLOADS[workload][1] // 1024} KiB, "
              f"{args.np} ranks, median of {args.rounds} rounds")
        print("| setting | steps/s | vs best fixed |")
        print("| --- | ---: | ---: |")
        for setting, rate, got in rows:
            if setting == "autotune":
                kept = ", ".join("%g MiB / %g ms" % tuple(g["kept"]) for g in got)
                tuned = ", ".join(str(g["tuning_steps"]) for g in got)
                name = f"autotune (kept {kept}; tuned in {tuned} steps)"
            else:
                name = f"{setting[0]:g} MiB, {setting[1]:g} ms"
            print(f"| {name} | {rate:.1f} | {rate / best[1]:.2f}x |")
        table.append({"workload": workload, "best_fixed": list(best[0]), "best_rate": best[1],
                      "autotune_rate": auto[1], "ratio": auto[1] / best[1],
                      "rows": [{"setting": str(s), "rate": r, "runs": g} for s, r, g in rows]})
    path = write_json("autotune", {"np": args.np, "rounds": args.rounds, "steps": args.steps,
                                   "workloads": table})
    print(path)


if __name__ == "__main__":
    main()
