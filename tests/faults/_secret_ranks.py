"""Code that runs inside the rank processes of the secret tests (tests/faults/test_secret.py).

A rank here notes what an attacker would look for (its pid, the job's secret as the
rank holds it) and what it started (children in its session, a child in a session of
its own, a daemon whose parent exited), then waits for the test's `go` file, bounded by
`seconds`.  The notes are `_fault_ranks.note` files.

The module is pickled by value (see the bottom), because Spark's executors cannot
import it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import cloudpickle

#: A shell that starts `sleep` in a session of its own and exits: the sleep's parent is gone.
_DAEMON = "setsid sleep 600 >/dev/null 2>&1 < /dev/null & echo $!"


def _note(outdir, rank, what, **data):
    import json

    path = os.path.join(outdir, f"{what}.{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def start_descendants() -> dict:
    """A child in this session, one in its own session, and a daemon re-parented away."""
    kid = subprocess.Popen(["sleep", "600"])
    detached = subprocess.Popen(["sleep", "600"], start_new_session=True)
    daemon = int(subprocess.run(["sh", "-c", _DAEMON], capture_output=True, text=True,
                                check=True).stdout)
    return {"kid": kid.pid, "detached": detached.pid, "daemon": daemon}


def hold(outdir, held=(0,), seconds=120.0, descendants=False):
    """Note this rank's facts; a held rank waits for `<outdir>/go` (bounded), then returns."""
    from collectives.launch.rankenv import RankEnv

    renv = RankEnv.from_environ()
    import collectives

    collectives.init()  # the rank takes its secret, as any rank that trains does
    started = start_descendants() if descendants else {}
    _note(outdir, renv.rank, "rank", pid=os.getpid(), secret=renv.secret.hex(),
          store=renv.store_addr, job=renv.job, **started)
    if renv.rank in held:
        deadline = time.monotonic() + seconds
        while not os.path.exists(os.path.join(outdir, "go")) and time.monotonic() < deadline:
            time.sleep(0.02)
    return renv.rank


def return_a_class_only_the_rank_has(moddir):
    """A value whose class lives in a module the launching process cannot import."""
    os.makedirs(moddir, exist_ok=True)
    # every rank writes it, at once: atomically, so no rank imports another's half-written
    # (truncated) file and fails with an AttributeError of its own
    part = os.path.join(moddir, f"hvs_rank_only_module.py.{os.getpid()}")
    with open(part, "w") as f:
        f.write("class OnlyHere:\n    pass\n")
    os.replace(part, os.path.join(moddir, "hvs_rank_only_module.py"))
    sys.path.insert(0, moddir)
    import hvs_rank_only_module

    return hvs_rank_only_module.OnlyHere()


def die_after_starting_descendants(outdir):
    """Start descendants, note them, then die by SIGKILL."""
    import signal

    rank = int(os.environ["HVS_RANK"])
    _note(outdir, rank, "rank", pid=os.getpid(), **start_descendants())
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


cloudpickle.register_pickle_by_value(sys.modules[__name__])
