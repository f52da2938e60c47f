"""The test side of the fault suite: run a job that is meant to fail, then look for leftovers.

Terms.  A job's rank processes carry a *tag* (HVS_FAULT_TAG in their
environment), so psutil can count the ones still alive after the driver
raised, on whatever executor they run.  An *outcome* is what a run left: the
exception the driver raised and when, the value if none, the notes the ranks
wrote (see `_fault_ranks`) and the rank output.  *Detection time* is the
driver's raise minus the victim's `killed` note: both are `time.time()` on one
machine.  Shared-memory segments of the native backend are named
`/dev/shm/hvs-<pid of the creating rank>-<random>`, so the segments a job
leaked are found from its ranks' pids.
"""
from __future__ import annotations

import dataclasses
import glob
import io
import json
import os
import time
import uuid
from typing import Any, Callable, Dict, Optional

import psutil

TAG_VAR = "HVS_FAULT_TAG"
#: Seconds a peer may make no progress before an op fails (HOROVOD_SPARK_TIMEOUT).
TIMEOUT = 10.0
#: Seconds to bootstrap (HOROVOD_SPARK_CONNECT_TIMEOUT).
CONNECT_TIMEOUT = 10.0


def new_tag() -> str:
    return uuid.uuid4().hex[:12]


class FaultJob:
    """One job with a fault: a directory for the ranks' notes and a tag on its processes."""

    def __init__(self, outdir) -> None:
        self.outdir, self.tag = str(outdir), new_tag()
        os.makedirs(self.outdir, exist_ok=True)

    def env(self, tcp: bool = False, timeout: float = TIMEOUT,
            connect_timeout: float = CONNECT_TIMEOUT, **extra) -> dict:
        # The tag is read from /proc/PID/environ, which a rank forked from a zygote does not
        # carry (it shows the zygote's): these jobs start their ranks fresh.  Faults of warm
        # ranks are tested in tests/spark/test_warm_start.py.
        env = {TAG_VAR: self.tag, "HOROVOD_SPARK_WARM_START": "0",
               "HOROVOD_SPARK_TIMEOUT": str(timeout),
               "HOROVOD_SPARK_CONNECT_TIMEOUT": str(connect_timeout),
               "HOROVOD_SPARK_FORCE_TCP": "1" if tcp else "0"}
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def cleanup(self) -> tuple:
        """Kill the processes and remove the segments the job left; returns their counts."""
        left = tagged(self.tag)
        kill_tagged(self.tag)
        segs = shm_segments([n["pid"] for n in notes(self.outdir, "pid").values()])
        remove_segments(segs)
        return len(left), len(segs)


# --------------------------------------------------------------------------- waiting

def wait_until(predicate: Callable[[], Any], timeout: float, what: str, every: float = 0.02):
    """predicate()'s first truthy value; AssertionError naming `what` after `timeout` s."""
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not true after {timeout:g} s")
        time.sleep(every)


# --------------------------------------------------------------------------- notes

def notes(outdir, what: str) -> Dict[int, dict]:
    out = {}
    for path in glob.glob(os.path.join(str(outdir), f"{what}.*.json")):
        rank = int(os.path.basename(path).split(".")[1])
        with open(path) as f:
            out[rank] = json.load(f)
    return out


def note_of(out, what: str, rank: int) -> dict:
    """The note `what` of `rank`; where there is none, an AssertionError that says how the
    job ended instead (a job that failed before the fault has no note of it)."""
    found = out.notes(what)
    assert rank in found, (f"rank {rank} left no {what!r} note; the job ended with "
                           f"{out.error!r}; errors noted: {out.notes('error')}")
    return found[rank]


@dataclasses.dataclass
class Outcome:
    error: Optional[BaseException]
    value: Any
    started_at: float
    raised_at: float
    outdir: str
    output: str

    def notes(self, what: str) -> Dict[int, dict]:
        return notes(self.outdir, what)

    @property
    def killed_at(self) -> Optional[float]:
        killed = self.notes("killed")
        return min(n["t"] for n in killed.values()) if killed else None

    @property
    def detect_s(self) -> Optional[float]:
        """Seconds from the fault to the driver's exception."""
        return None if self.killed_at is None else self.raised_at - self.killed_at

    def pids(self) -> list:
        return [n["pid"] for n in self.notes("pid").values()]


def run_job(launch: Callable[[io.StringIO], Any], outdir) -> Outcome:
    """launch(sink) runs a job with its output going to sink; keep what happened."""
    sink = io.StringIO()
    t0 = time.time()
    try:
        value, error = launch(sink), None
    except Exception as exc:  # the driver's failure is the result under test
        value, error = None, exc
    return Outcome(error, value, t0, time.time(), str(outdir), sink.getvalue())


def run_local_job(fn, np_: int, args=(), env=None, outdir=".", timeout: float = 90.0,
                  hosts=None) -> Outcome:
    from collectives.launch import run_local

    return run_job(lambda sink: run_local(fn, np_, args=args, env=env, stdout=sink, stderr=sink,
                                          timeout=timeout, hosts=hosts), outdir)


def run_spark_job(fn, np_: int, args=(), env=None, outdir=".", **kw) -> Outcome:
    import horovod_spark

    def launch(sink):
        return horovod_spark.run(fn, args=args, num_proc=np_, env=env, stdout=sink, stderr=sink,
                                 verbose=0, **kw)

    return run_job(launch, outdir)


# --------------------------------------------------------------------------- leftovers

def tagged(tag: str, keepers: bool = True) -> list:
    """Live (not zombie) processes whose environment carries the tag (with keepers=False,
    the rank processes only, not their keepers)."""
    from collectives.launch.procs import KEEPER

    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get(TAG_VAR) == tag and \
                    (keepers or KEEPER not in p.cmdline()):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def wait_gone(tag: str, timeout: float = 10.0) -> tuple:
    """(seconds until no tagged process was left, processes still left at the timeout)."""
    t0 = time.monotonic()
    while True:
        left = tagged(tag)
        if not left or time.monotonic() - t0 > timeout:
            return time.monotonic() - t0, left
        time.sleep(0.05)


def kill_tagged(tag: str) -> None:
    """SIGKILL what a failed test left (processes this suite started, found by their tag)."""
    for p in tagged(tag):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def shm_segments(pids) -> list:
    """/dev/shm segments created by any of these rank pids."""
    return sorted(os.path.basename(p) for pid in pids for p in glob.glob(f"/dev/shm/hvs-{pid}-*"))


def remove_segments(names) -> None:
    for name in names:
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except FileNotFoundError:
            pass


def rss() -> int:
    return psutil.Process().memory_info().rss
