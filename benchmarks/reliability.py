"""Reliability figures: faults injected, time to detect each, leftovers, fuzzing, soak.

    python benchmarks/reliability.py [--repeat 3] [--no-spark] [--json PATH]

Runs the faults of tests/faults (the same rank code, `tests/faults/_fault_ranks.py`)
and measures what the tests only bound:

* detect: seconds from the fault (the victim's note, written just before its
  SIGKILL / reset / stall) to the driver's exception; for stalls and silent peers,
  to the survivors' errors;
* survivors: how many surviving ranks exited with a named error (class, own rank,
  a peer) before the launcher stopped them;
* left: rank processes alive 10 s after the driver raised (psutil, by a tag in
  their environment), and /dev/shm/hvs-<rank pid>-* segments;
* fuzz: connections refused per server and the server process's RSS growth;
* soak: 10,000 fused allreduces across 3 ranks, exactness and RSS growth.

Every job runs on this machine; numbers on a shared CPU are noisy.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "tests", "faults")]

import _fault_attacks as attacks  # noqa: E402
import _fault_kit as kit  # noqa: E402
import _fault_ranks as ranks  # noqa: E402
import _fault_work as work  # noqa: E402

SECRET = os.urandom(32)


def job_at(root: str, name: str) -> kit.FaultJob:
    """A fault job whose notes go to root/name."""
    return kit.FaultJob(os.path.join(root, name.replace(" ", "_").replace("/", "_")))


def _named(notes: dict, victim: int, size: int) -> str:
    ok = sum(1 for r, e in notes.items() if r != victim and f"on rank {r}/{size}" in e["message"]
             and e["type"] in ("PeerLostError", "CollectiveTimeout"))
    return f"{ok}/{size - 1}"


def measure(job: kit.FaultJob, out, victim: int, size: int, since: str = "killed") -> dict:
    kit.wait_gone(job.tag, 10.0)
    procs, segs = job.cleanup()
    t_fault = min(n["t"] for n in out.notes(since).values()) if out.notes(since) else None
    errors = out.notes("error")
    first_err = min((e["t"] for r, e in errors.items() if r != victim), default=None)
    return {
        "fired": bool(out.notes(since)),
        "raised": type(out.error).__name__ if out.error else "nothing",
        "why": "" if out.notes(since) or not out.error else str(out.error).splitlines()[0][:160],
        "rank named": getattr(out.error, "rank", None) if out.error else None,
        "detect_s": None if t_fault is None else round(out.raised_at - t_fault, 3),
        "survivor_s": None if t_fault is None or first_err is None
        else round(first_err - t_fault, 3),
        "survivors named": _named(errors, victim, size),
        "procs left": procs, "shm left": segs,
    }


# --------------------------------------------------------------------------- the faults

def local_faults(root: str, repeat: int) -> list:
    rows = []

    def run(name, fn, args, victim, size=3, since="killed", **env):
        for i in range(repeat):
            job = job_at(root, f"{name}-{i}")
            a = args(job, i) if callable(args) else args
            out = kit.run_local_job(fn, size, args=a, env=job.env(**env), outdir=job.outdir)
            rows.append(dict(fault=name, **measure(job, out, victim, size, since)))

    delay = lambda i: random.Random(i).uniform(0.1, 1.0)  # noqa: E731
    for tcp in (False, True):
        t = "tcp" if tcp else "shm"
        run(f"SIGKILL, random point of training ({t})", ranks.train_and_die,
            lambda j, i: (j.outdir, 1, delay(i)), 1, tcp=tcp)
        run(f"SIGKILL inside a fused allreduce ({t})", ranks.die_in_fused_allreduce,
            lambda j, i: (j.outdir, 1, 1 + i % 3), 1, tcp=tcp)
    run("SIGKILL, random point of hvd training (shm)", ranks.train_and_die,
        lambda j, i: (j.outdir, 2, delay(i) / 2, "fused", 1 << 17), 2)
    for point, victim in (("before-init", 1), ("after-publishing-its-address", 1),
                          ("after-publishing-the-shm-name", 0),
                          ("after-creating-shared-memory", 0)):
        run(f"SIGKILL in rendezvous, {point}", ranks.rendezvous_and_die,
            lambda j, i, p=point, v=victim: (j.outdir, v, p), victim)
    run("connection reset mid-transfer (tcp)", ranks.train_and_reset,
        lambda j, i: (j.outdir, 1, delay(i)), 1, tcp=True)
    return rows


def stall_faults(root: str) -> list:
    rows = []
    job = job_at(root, "stall-fused")
    out = kit.run_local_job(ranks.stall_in_fused, 3, args=(job.outdir, 2, 2), outdir=job.outdir,
                            env=job.env(timeout=30, HOROVOD_STALL_CHECK_TIME_SECONDS=1,
                                        HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=3))
    rows.append(dict(fault="stalled rank, fused (check 1 s, shutdown 3 s)",
                     **measure(job, out, 2, 3, "stalled")))
    for tcp in (False, True):
        for freeze in (False, True):
            job = job_at(root, f"stall-plain-{tcp}-{freeze}")
            out = kit.run_local_job(ranks.stall_in_allreduce, 3, args=(job.outdir, 1, 3, freeze),
                                    env=job.env(tcp=tcp, timeout=3), outdir=job.outdir)
            what = "SIGSTOPped" if freeze else "sleeping"
            rows.append(dict(fault=f"{what} rank, plain allreduce, timeout 3 s "
                                   f"({'tcp' if tcp else 'shm'})",
                             **measure(job, out, 1, 3, "stalled")))
    job = job_at(root, "silent-peer")
    out = kit.run_local_job(ranks.silent_rank0, 3, args=(job.outdir, 30.0), outdir=job.outdir,
                            env=job.env(tcp=True, connect_timeout=3))
    row = measure(job, out, 0, 3, "pid")
    rows.append(dict(fault="peer accepts, never answers, connect_timeout 3 s", **row))
    return rows


def driver_death(root: str) -> list:
    import signal
    import subprocess

    rows = []
    for sig in (signal.SIGKILL, signal.SIGTERM):
        job = job_at(root, f"driver-{sig.name}")
        code = (f"import sys; sys.path[:0] = {sys.path!r}\nimport _fault_ranks as r\n"
                f"from collectives.launch import run_local\nrun_local(r.train_and_die, 3, "
                f"args=({job.outdir!r}, -1, 0.0), env={job.env(tcp=True)!r})\n")
        drv = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
        kit.wait_until(lambda: len(kit.notes(job.outdir, "pid")) == 3, 60, "ranks start")
        t0 = time.monotonic()
        drv.send_signal(sig)
        drv.wait(30)
        seconds, left = kit.wait_gone(job.tag, 10.0)
        rows.append({"fault": f"driver {sig.name}ed",
                     "ranks gone_s": round(time.monotonic() - t0, 3), "procs left": len(left)})
        job.cleanup()
    return rows


def spark_faults(root: str) -> list:
    rows = []
    for name, fn, args, tcp in (
            ("Spark: SIGKILL during training (tcp)", ranks.train_and_die, (1, 0.5), True),
            ("Spark: SIGKILL during hvd training", ranks.train_and_die, (1, 0.5, "fused"), False),
            ("Spark: SIGKILL before rendezvous", ranks.rendezvous_and_die, (1, "before-init"),
             False)):
        job = job_at(root, name)
        out = kit.run_spark_job(fn, 2, args=(job.outdir,) + args, env=job.env(tcp=tcp),
                                outdir=job.outdir)
        rows.append(dict(fault=name, **measure(job, out, 1, 2)))
    return rows


# --------------------------------------------------------------------------- fuzz and soak

def fuzz(n: int) -> list:
    rows = []
    for name in ("store", "task-store", "log"):
        svc = attacks.make_service(name, os.urandom(32))
        try:
            strings = attacks.fuzz_strings(seed=10, n=n)
            attacks.attack_fuzz(svc.address, strings[:500])
            before, rss = svc.rejected(), kit.rss()
            t0 = time.monotonic()
            answered = attacks.attack_fuzz(svc.address, strings[500:])
            took = time.monotonic() - t0
            growth = kit.rss() - rss
            kit.wait_until(lambda: svc.rejected() - before >= n - 500, 10, "rejections counted")
            svc.works()
            rows.append({"server": name, "inputs": n, "refused": svc.rejected() - before + 500,
                         "answered": answered, "rss growth KiB": growth >> 10,
                         "per connection ms": round(1000 * took / (n - 500), 3)})
        finally:
            svc.close()
    return rows


def job_under_attack(n: int) -> list:
    """The store and rank 0's mesh listener of a live job, attacked while rank 1 is held."""
    import psutil

    job = job_at("/tmp", f"hvs-attack-{os.getpid()}")
    group, store = attacks.held_job(job, 2, (1,), SECRET, connect_timeout=300.0)
    with group:
        mesh = attacks.rank0_listener(job, group, store)
        rank0 = psutil.Process(kit.notes(job.outdir, "pid")[0]["pid"])
        rows = []
        for name, addr, ctx, proc in (("launcher store (live job)", store.address, "store", None),
                                      ("rank 0 mesh listener (live job)", mesh, "mesh", rank0)):
            proc = proc or psutil.Process()
            rss, t0 = proc.memory_info().rss, time.monotonic()
            got = attacks.battery(addr, ctx, SECRET, n)
            rows.append({"server": name, "inputs": n + 4, "answered": len(got),
                         "rss growth KiB": (proc.memory_info().rss - rss) >> 10,
                         "per connection ms": round(1000 * (time.monotonic() - t0) / (n + 4), 3)})
        results, codes = attacks.finish_held(job, group)
    ok = codes == [0, 0] and all(v["value"] == 3.0 for v in results.values())
    for r in rows:
        r["job result unchanged"] = ok
    job.cleanup()
    return rows


def soak(total: int) -> dict:
    job = job_at("/tmp", f"hvs-soak-{os.getpid()}")
    t0 = time.monotonic()
    out = kit.run_local_job(work.soak, 3, args=(total, 50, 2024), outdir=job.outdir, timeout=600,
                            env=job.env(HOROVOD_FUSION_THRESHOLD=256 * 1024))
    if out.error:
        return {"error": str(out.error)[:500]}
    return {"allreduces per rank": out.value[0]["count"], "ranks": 3,
            "seconds": round(time.monotonic() - t0, 1),
            "wrong": sum(r["wrong"] for r in out.value),
            "float32 digests": len({r["float_digest"] for r in out.value}),
            "float32 worst": max(r["float_worst"] for r in out.value),
            "distinct digests": len({r["digest"] for r in out.value}),
            "rss growth KiB (per rank)": [(r["rss"][-1] - r["rss"][0]) >> 10 for r in out.value],
            "rss MiB at the end": [r["rss"][-1] >> 20 for r in out.value]}


# --------------------------------------------------------------------------- report

def table(rows: list) -> str:
    if not rows:
        return ""
    cols = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def summarize(rows: list) -> list:
    """One line per fault: the median and max detection over the repetitions."""
    out = {}
    for r in rows:
        out.setdefault(r["fault"], []).append(r)
    summary = []
    for fault, rs in out.items():
        det = [r["detect_s"] for r in rs if r["detect_s"] is not None]
        surv = [r["survivor_s"] for r in rs if r["survivor_s"] is not None]
        fired = sum(r["fired"] for r in rs)
        if fired < len(rs):  # the job failed for another reason: say which, measure nothing
            summary.append({"fault": fault, "runs": len(rs), "fired": fired,
                            "raised": next(r["why"] for r in rs if not r["fired"])})
            continue
        summary.append({"fault": fault, "runs": len(rs), "fired": fired, "raised": rs[0]["raised"],
                        "rank named": sorted({str(r["rank named"]) for r in rs}),
                        "detect s (median/max)": f"{statistics.median(det):.2f} / {max(det):.2f}"
                        if det else "-",
                        "survivors' error s (median)":
                            f"{statistics.median(surv):.2f}" if surv else "-",
                        "survivors named": sorted({r["survivors named"] for r in rs}),
                        "procs left": sum(r["procs left"] for r in rs),
                        "shm left": sum(r["shm left"] for r in rs)})
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3, help="runs of each random fault")
    p.add_argument("--no-spark", action="store_true")
    p.add_argument("--fuzz", type=int, default=10_000)
    p.add_argument("--soak", type=int, default=10_000)
    p.add_argument("--json", default=os.path.join(HERE, "results", "reliability.json"))
    ns = p.parse_args(argv)
    root = f"/tmp/hvs-reliability-{os.getpid()}"
    report = {"faults": summarize(local_faults(root, ns.repeat) + stall_faults(root))}
    if not ns.no_spark:
        report["faults"] += summarize(spark_faults(root))
    report["driver death"] = driver_death(root)
    report["fuzz"] = fuzz(ns.fuzz) + job_under_attack(ns.fuzz)
    report["soak"] = soak(ns.soak)
    for key in ("faults", "driver death", "fuzz"):
        print(f"\n## {key}\n\n{table(report[key])}")
    print(f"\n## soak\n\n{table([report['soak']])}")
    os.makedirs(os.path.dirname(ns.json), exist_ok=True)
    with open(ns.json, "w") as f:
        json.dump(report, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
