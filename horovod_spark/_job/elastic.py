"""Elastic jobs, the driver side: attempts that resume from the last commit, sized by the slots.

Terms.  An elastic job runs *attempts* of `BarrierJob` (on Spark) or of the local launcher
(np < 0) until one returns.  Before each attempt the driver counts the free barrier slots
and runs with as many as there are between `min_np` and `max_np`, waiting up to
`start_timeout` (first attempt) or `elastic_timeout` (later ones) for `min_np`.  The
*keeper* puts the world record and the last committed state in the attempt's job store
before its ranks start, and takes the committed state back when the attempt ends, so it
outlives the ranks (see `horovod_spark.common.elastic` for the rank side).  A failure of the
world (a rank that died, a lost executor or peer) *resets* the job: the next attempt
starts from the last commit, after at most `reset_limit` resets.  A failure of the
function itself (its own exception, a result too large, the job's timeout) is raised at
once: running it again from the same commit would fail the same way.  *Growing*: while an
attempt runs the driver watches the free slots; when more are free than the attempt has
ranks (up to `max_np`), it puts an offer in the attempt's store, every rank raises
HostsUpdatedInterrupt at its next commit, and the next attempt starts with more ranks
from that commit (no reset counted, no work lost).
"""
from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
from typing import Callable, List, Optional, Tuple

from collectives.errors import describe
from collectives.launch.record import Failure

from ..common.elastic import World, commit_key, grow_key, world_key
from . import checks
from .failure import JobFailedError

__all__ = ["ElasticOptions", "Attempt", "ResetLimitError", "NotEnoughSlotsError",
           "run_elastic_on_spark", "run_elastic_on_driver"]

RESETTING = ("death", "comm", "aborted")  # failure kinds of the world, not of the function


@dataclasses.dataclass(frozen=True)
class ElasticOptions:
    min_np: int
    max_np: int
    elastic_timeout: float
    reset_limit: Optional[int]   # None: no limit


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One failed attempt: its number (1-based), its size and its root cause."""
    number: int
    size: int
    failure: Failure

    def line(self) -> str:
        f = self.failure
        where = f"rank {f.rank}" if f.rank is not None else "the job"
        if f.host:
            where += f" on host {f.host}"
        return f"attempt {self.number} ({self.size} ranks): {where}: {f.error_type}: " \
               f"{f.message.splitlines()[0] if f.message else ''}"[:400]


def _history_text(history: Tuple[Attempt, ...]) -> str:
    return "\n".join(f"  {a.line()}" for a in history)


class ResetLimitError(JobFailedError):
    """The job failed more times than `reset_limit` allows; names every attempt's failure.
    As a JobFailedError it describes the last one (its rank, traceback, output)."""

    def __init__(self, history: Tuple[Attempt, ...], reset_limit: int,
                 files=None) -> None:
        self.history, self.reset_limit = tuple(history), reset_limit
        last = self.history[-1]
        super().__init__(last.failure, last.number - 1, len(self.history), files)

    def __reduce__(self):
        return (type(self), (self.history, self.reset_limit))

    def _text(self) -> str:
        head = (f"elastic job: reset_limit={self.reset_limit} reached after "
                f"{len(self.history)} failed attempts:\n{_history_text(self.history)}\n"
                f"the last failure: ")
        return head + super()._text()


class NotEnoughSlotsError(ValueError):
    """Fewer free barrier slots than `min_np` after the timeout; names the failures so far."""

    def __init__(self, message: str, history: Tuple[Attempt, ...] = ()) -> None:
        self.message, self.history = message, tuple(history)
        if self.history:
            message += f"\nearlier attempts:\n{_history_text(self.history)}"
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (self.message, self.history))


class Keeper:
    """The last committed state of the job, between attempts."""

    def __init__(self) -> None:
        self.blob: Optional[bytes] = None
        self.live: Optional[tuple] = None  # (store, job) of the attempt that runs

    def seed(self, store, job: str, attempt: int, np_: int) -> None:
        """Before the attempt's ranks start: the world record, and the commit if there is one."""
        if store is None:
            raise ValueError("an elastic job keeps the committed state in the job store on the "
                             "driver, and this attempt has none (the driver could not listen on "
                             "its address); see the warning above")
        if self.blob is not None:
            store.set(commit_key(job), self.blob)
        store.set(world_key(job), World(attempt, np_, self.blob is not None).encode())
        self.live = (store, job)

    def keep(self, store, job: str) -> None:
        """After the attempt: the last state its rank 0 committed, if it committed any."""
        self.live = None
        key = commit_key(job)
        if store.check(key):
            self.blob = store.get(key)


def elastic_slots(cluster, eopts: ElasticOptions, timeout: float, say,
                  history: Tuple[Attempt, ...] = ()) -> int:
    """Ranks for the next attempt: the free slots, capped at max_np, once there are min_np;
    NotEnoughSlotsError when they do not come within `timeout`."""
    local = checks.local_slots(cluster.conf, cluster.master) is not None
    start = next_note = time.monotonic()
    while True:
        slots = cluster.available_slots()
        if slots is None:  # a Connect client that cannot count them: ask for the most
            return eopts.max_np
        if slots >= eopts.min_np:
            return min(slots, eopts.max_np)
        waited = time.monotonic() - start
        if local or waited >= timeout:
            raise NotEnoughSlotsError(describe(
                f"elastic job: {slots} free barrier task slots after {waited:.0f} s, fewer than "
                f"min_num_proc={eopts.min_np}", op="run_elastic", timeout=None if local else timeout,
                hint="add executors or cores, or lower min_num_proc"), history)
        if time.monotonic() >= next_note + 10:
            next_note = time.monotonic()
            say(f"elastic job: waiting for slots: {slots} of min_num_proc={eopts.min_np} after "
                f"{waited:.0f} s (timeout {timeout:g} s)")
        time.sleep(0.2)


def offer_growth(cluster, keeper: Keeper, np_: int, eopts: ElasticOptions, stop, say,
                 every: float = 1.0) -> None:
    """While an attempt of np_ ranks runs (until `stop`): once more slots are free than it
    has ranks, up to max_np, the offer goes into its store (see the module docstring)."""
    if np_ >= eopts.max_np:
        return
    while not stop.wait(every):
        live = keeper.live
        if live is None:
            continue
        try:
            slots = cluster.available_slots()
        except Exception:  # the session is busy or going away: look again
            continue
        if slots is None or min(slots, eopts.max_np) <= np_:
            continue
        store, job = live
        grown = min(slots, eopts.max_np)
        try:
            store.set(grow_key(job), json.dumps({"from": np_, "to": grown}).encode())
        except Exception:  # the attempt ended meanwhile
            return
        say(f"elastic job: {slots} barrier slots now, {np_} ranks: growing to {grown} at the "
            f"next commit")
        return


def _grew(failure: Failure) -> bool:
    """Whether an attempt ended at a commit because the driver offered more slots."""
    return failure.error_type == "HostsUpdatedInterrupt"


def _attempts(opts, eopts: ElasticOptions, size_of: Callable[[int, tuple], int],
              attempt: Callable[[int, int], list], files) -> list:
    """Run attempts until one returns (see the module docstring)."""
    history: List[Attempt] = []
    number = 0
    while True:
        np_ = size_of(number, tuple(history))
        try:
            return attempt(number, np_)
        except JobFailedError as err:
            failure = err.failure
            if _grew(failure):
                opts.say(1, f"elastic job: attempt {number + 1} ({np_} ranks) ended at a commit "
                            f"to grow; resuming from it")
                number += 1
                continue
            if failure.kind not in RESETTING:
                raise
            history.append(Attempt(number + 1, np_, failure))
            if eopts.reset_limit is not None and len(history) > eopts.reset_limit:
                raise ResetLimitError(tuple(history), eopts.reset_limit, files) from None
            opts.say(1, f"elastic job: {history[-1].line()}; resuming from the last commit")
            number += 1


def run_elastic_on_spark(spark, payload: bytes, opts, eopts: ElasticOptions, files) -> list:
    """Attempts of one BarrierJob; the last attempt's values in rank order."""
    from .cluster import Cluster
    from .driver import BarrierJob

    cluster = Cluster(spark, opts.settings.client_address or "")
    if opts.settings.rendezvous == "spark" or not cluster.reachable:
        raise ValueError("run_elastic keeps the committed state in the job store on the driver, "
                         "which the executors must reach: unset HOROVOD_SPARK_RENDEZVOUS=spark, "
                         "or set HOROVOD_SPARK_CLIENT_ADDRESS to an address they reach")
    def say(message: str) -> None:
        opts.say(1, message)

    first = elastic_slots(cluster, eopts, opts.start_timeout, say)
    job = BarrierJob(spark, dataclasses.replace(opts, np=first), files)
    job.keeper = Keeper()

    def size_of(number: int, history: tuple) -> int:
        np_ = first if number == 0 else elastic_slots(job.cluster, eopts, eopts.elastic_timeout,
                                                       say, history)
        job.resize(np_)
        return np_

    def attempt(number: int, np_: int) -> list:
        stop = threading.Event()
        watch = threading.Thread(target=offer_growth, daemon=True, name="elastic-growth",
                                 args=(job.cluster, job.keeper, np_, eopts, stop, say))
        watch.start()
        try:
            return job.attempt(number, payload)
        finally:
            stop.set()
            watch.join(5)

    rows = _attempts(opts, eopts, size_of, attempt, files)
    return job.values(rows)


def run_elastic_on_driver(payload: bytes, opts, eopts: ElasticOptions, files) -> list:
    """Attempts of -opts.np local ranks (no slots to count: every attempt has them all)."""
    from collectives.launch import RankFailed
    from collectives.launch.launcher import start_ranks
    from collectives.launch.procs import finish_grace

    keeper, env = Keeper(), dict(opts.env)

    def attempt(number: int, np_: int) -> list:
        group, server = start_ranks(
            [opts.executable or sys.executable, "-m", "collectives.launch.worker"], np_, env,
            stdout=opts.stdout, stderr=opts.stderr, payload=payload,
            prepare=lambda store, job: keeper.seed(store, job, number, np_), attempt=number)
        with group:
            try:
                return group.wait_results(opts.timeout, finish_grace(env))
            except RankFailed as exc:
                failure = dataclasses.replace(exc.failure, size=np_,
                                              host=exc.failure.host or "localhost")
                raise JobFailedError(failure, number, number + 1, files) from None
            finally:
                group.kill()  # the ranks are gone before their last commit is read
                keeper.keep(server, group.job)

    return _attempts(opts, eopts, lambda number, history: -opts.np, attempt, files)
