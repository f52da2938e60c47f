"""Rank code of the default-settings fault tests: careless jobs run with the defaults.

Each function is a training function a careless user could write: ranks that
submit one name as different kinds, ranks that run different step counts, a
rank frozen after its last collective.  Notes (see `_fault_ranks.note`) tell
the test what each rank did and when.  Every wait here is bounded, so a fix
that does not fire ends the job (and fails the test) rather than hanging it.

Pickled by value (see the bottom): Spark's executors cannot import this module.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import cloudpickle

# by value too (see that module's bottom), so Spark's executors need not import it
from _fault_ranks import communicator_through, die_later, guarded


def note(outdir, rank, what, **data):
    import json

    path = os.path.join(outdir, f"{what}.{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def _noted(outdir, body):
    """body(hvd) after hvd.init(); the error a rank sees goes in a note before it leaves."""
    import horovod_spark.torch as hvd

    hvd.init()
    rank = hvd.rank()
    note(outdir, rank, "pid", pid=os.getpid(), t=time.time())
    try:
        return body(hvd, rank)
    except BaseException as exc:
        note(outdir, rank, "error", type=type(exc).__name__, message=str(exc), t=time.time())
        raise


def kinds_differ(outdir, check_s=None, shutdown_s=None):
    """Rank 0 allreduces 'x', the others allgather 'x': a stall no rank can end.

    check_s, shutdown_s: the stall times, set in the function's own environment
    before hvd.init() (what a HorovodRunner user can do)."""
    for var, value in (("HOROVOD_STALL_CHECK_TIME_SECONDS", check_s),
                       ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", shutdown_s)):
        if value is not None:
            os.environ[var] = str(value)

    def body(hvd, rank):
        import torch

        t = torch.ones(4)
        note(outdir, rank, "submitted", t=time.time())
        if rank == 0:
            return hvd.allreduce(t, name="x").tolist()
        return hvd.allgather(t, name="x").tolist()

    return _noted(outdir, body)


def uneven_steps(outdir, extra_rank=1, steps=3):
    """Every rank runs `steps` allreduces of 'x'; `extra_rank` runs one more."""
    def body(hvd, rank):
        import torch

        for _ in range(steps + (rank == extra_rank)):
            if rank == extra_rank:
                note(outdir, rank, "waiting", t=time.time())
            hvd.allreduce(torch.ones(4), name="x")
        note(outdir, rank, "returned", t=time.time())
        return rank

    return _noted(outdir, body)


def frozen_after_last_op(outdir, frozen=1, steps=3):
    """Every rank runs the same steps; then `frozen` SIGSTOPs itself instead of returning."""
    def body(hvd, rank):
        import torch

        for _ in range(steps):
            hvd.allreduce(torch.ones(4), name="x")
        if rank == frozen:
            note(outdir, rank, "frozen", t=time.time())
            os.kill(os.getpid(), signal.SIGSTOP)
        note(outdir, rank, "returned", t=time.time())
        return rank

    return _noted(outdir, body)


def sleeps(outdir, seconds):
    """A job that runs longer than its whole-job timeout."""
    note(outdir, int(os.environ["HVS_RANK"]), "pid", pid=os.getpid(), t=time.time())
    time.sleep(seconds)
    return "slept"


class _BadStr(Exception):
    def __str__(self):
        raise RuntimeError("__str__ is broken too")


def raises_unprintable(code=7):
    """An exception whose __str__ raises."""
    raise _BadStr("disk full", code)


def unpicklable_on_rank1():
    """Rank 1 returns a value that cannot be pickled (a lock); rank 0 a plain one."""
    import threading

    return threading.Lock() if int(os.environ["HVS_RANK"]) == 1 else "rank 0's value"


def secret_seen_by_a_subprocess():
    """Whether HVS_SECRET reaches a subprocess the training function starts."""
    import subprocess
    import sys

    import collectives

    comm = collectives.init()  # the rank still joins the job after the environment dropped it
    comm.barrier()
    comm.close()
    probe = "import os; print(repr(os.environ.get('HVS_SECRET')))"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True).stdout.strip(), "HVS_SECRET" in os.environ


def timeline_without_shutdown(path, steps=5):
    """hvd.init() with a timeline, a few allreduces, and no hvd.shutdown()."""
    os.environ["HOROVOD_TIMELINE"] = path
    import horovod_spark.torch as hvd
    import torch

    hvd.init()
    for _ in range(steps):
        hvd.allreduce(torch.ones(8), name="x")
    return hvd.rank()


def long_lines(mib=2, redraws=2000):
    """A line of `mib` MiB, a progress bar redrawn with \r and never ended, then one more line."""
    import sys

    rank = int(os.environ["HVS_RANK"])
    sys.stdout.write("x" * (mib << 20) + "\n")
    for i in range(redraws):
        sys.stdout.write(f"\rprogress {i}/{redraws} " + "#" * (i % 60))
    sys.stdout.write("\n")
    print(f"rank {rank}: after the long lines", flush=True)
    return rank


def many_lines(n):
    """n numbered lines on stdout, as fast as print goes."""
    import sys

    rank = int(os.environ["HVS_RANK"])
    write = sys.stdout.write
    for i in range(n):
        write(f"r{rank} line {i}\n")
    sys.stdout.flush()
    return n


def job_killed_while_sharing_memory(outdir, late_s=5.0):
    """Local rank 0 creates its segment and dies 0.3 s later; the others come `late_s` s late
    to attach, so the launcher (or Spark) kills them first: nobody of the job unlinks it."""
    rank = int(os.environ["HVS_RANK"])

    def hook(op, key, before):
        if "/native/shm/" not in key:
            return
        if rank == 0 and op == "set" and not before:
            die_later(outdir, 0, 0.3, "after creating shared memory")
        elif rank != 0 and op == "get" and before:
            time.sleep(late_s)

    return guarded(outdir, lambda: communicator_through(hook).size)


def job_cancelled_while_sharing_memory(outdir, late_s=20.0):
    """Local rank 0 creates its segment and notes it ("holding"); the others come `late_s`
    s late to attach, so a cancellation the test sends on that note lands while a named
    segment exists that only the job can remove."""
    rank = int(os.environ["HVS_RANK"])

    def hook(op, key, before):
        if "/native/shm/" not in key:
            return
        if rank == 0 and op == "set" and not before:  # it publishes the name, then creates
            threading.Thread(target=noted_when_created, daemon=True).start()
        elif rank != 0 and op == "get" and before:
            time.sleep(late_s)

    def noted_when_created():
        for _ in range(500):  # bounded: 5 s
            mine = [n for n in os.listdir("/dev/shm") if n.startswith(f"hvs-{os.getpid()}-")]
            if mine:
                note(outdir, 0, "holding", t=time.time(), shm=mine)
                return
            time.sleep(0.01)

    return guarded(outdir, lambda: communicator_through(hook).size)


def large_result(mib):
    """Rank 0 returns `mib` MiB of bytes (a position in every MiB, to check them); the
    others return a small value, which HorovodRunner throws away."""
    if int(os.environ["HVS_RANK"]) != 0:
        return "small"
    out = bytearray(mib << 20)
    for i in range(mib):
        out[i << 20] = i % 251
    return bytes(out)


def rank_1_skips_init():
    """Rank 1 returns at once, never calling init(); rank 0 joins and allreduces."""
    if int(os.environ["HVS_RANK"]) == 1:
        return "skipped"
    import collectives
    import numpy as np

    comm = collectives.init()
    return comm.allreduce(np.ones(2)).tolist()


cloudpickle.register_pickle_by_value(__import__(__name__))
