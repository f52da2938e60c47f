"""Shared-memory segments left when a process is SIGKILLed while ranks bootstrap.

    python benchmarks/segment_kills.py                       # 100 trials per victim
    python benchmarks/segment_kills.py --trials 30 --victims launcher

A trial starts `python -m collectives.launch -n 3` on a script whose ranks bootstrap the
communicator (local rank 0 creates the host's segment, the others attach) and reduce once,
then SIGKILLs the *victim* at a random moment of the bootstrap: the launcher (as a Spark
task's Python worker or executor dies), local rank 0 (the segment's creator), or rank 2
(one that attaches), or a rank's keeper.  When every process of the trial has ended, it
counts the `/dev/shm/hvs-*` entries that were not there before (and removes them, so the
next trial starts clean).  Prints leaks per victim, and how many trials the kill landed
before the job had finished.
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = """
import numpy as np
import collectives
comm = collectives.init()
comm.allreduce(np.ones(1 << 16, np.float32))
comm.close()
"""
VICTIMS = ("launcher", "rank0", "rank2", "keeper0")


def _segments() -> set:
    return {n for n in os.listdir("/dev/shm") if n.startswith("hvs-")}


def _ranks(launcher: psutil.Process) -> dict:
    """{"rank0": proc, "keeper0": proc, ...} among the launcher's descendants so far."""
    found = {}
    for p in launcher.children(recursive=True):
        try:
            env = p.environ()
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        rank = env.get("HVS_RANK")
        if rank is None:
            continue
        found[("keeper" if "keeper" in cmd else "rank") + rank] = p
    return found


def trial(victim: str, script: str, window: float) -> tuple:
    """(segments left, whether the kill landed before the job ended)."""
    before = _segments()
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    launcher = subprocess.Popen([sys.executable, "-m", "collectives.launch", "-n", "3", script],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    proc = psutil.Process(launcher.pid)
    landed, target, at = False, None, None
    began = time.monotonic()
    while time.monotonic() - began < 20 and launcher.poll() is None:
        now = time.monotonic()
        if target is None:
            if victim == "launcher":
                target, at = proc, began + random.uniform(0, window)
            else:
                found = _ranks(proc).get(victim)
                if found is not None:  # started: the kill lands in its import or bootstrap
                    target, at = found, now + random.uniform(0, window / 2)
        if target is not None and now >= at:
            try:
                target.send_signal(signal.SIGKILL)
                landed = launcher.poll() is None
            except psutil.Error:
                pass
            break
        time.sleep(0.002)
    # every process of the trial ends by itself (bounded: the job's timeouts), or it counts
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        alive = [p for p in psutil.process_iter(["environ"])
                 if (p.info.get("environ") or {}).get("HVS_SEGMENT_TRIAL") == script]
        if launcher.poll() is not None and not alive:
            break
        time.sleep(0.05)
    if launcher.poll() is None:
        launcher.kill()
    launcher.wait()
    left = _segments() - before
    for name in left:
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except OSError:
            pass
    return len(left), landed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=100)
    p.add_argument("--victims", default=",".join(VICTIMS))
    p.add_argument("--window", type=float, default=1.2,
                   help="seconds after the start in which the kill lands (the bootstrap)")
    args = p.parse_args()
    scratch = tempfile.mkdtemp(prefix="hvs-kills-")
    script = os.path.join(scratch, "bootstrap.py")
    with open(script, "w") as f:
        f.write(SCRIPT)
    os.environ["HVS_SEGMENT_TRIAL"] = script  # marks the trial's processes (inherited)
    print(f"# {args.trials} trials per victim; kill at a random moment of the first "
          f"{args.window:g} s; 3 local ranks")
    print(f"# {'victim':>9} {'trials':>7} {'landed':>7} {'leaked':>7}")
    for victim in args.victims.split(","):
        leaked = landed = 0
        for _ in range(args.trials):
            n, hit = trial(victim, script, args.window)
            leaked += n > 0
            landed += hit
        print(f"  {victim:>9} {args.trials:>7} {landed:>7} {leaked:>7}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
