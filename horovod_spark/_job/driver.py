"""The driver side of a job: pickle, check, submit one barrier stage, gather.

Terms.  A *job* is one call of `run` / `HorovodRunner.run`; an *attempt* is
one barrier stage of it (`max_restarts` adds attempts after a failure).  The
*payload* is the cloudpickle of (fn, args, kwargs).  Each attempt has its own
key prefix (`hvs-<job id>/a<attempt>`) and log server; the job has one secret.

A failed attempt is explained by *failure records* (see `_task`), which
arrive on the log channel and inside Spark's exception text.  The *root
cause* is chosen the way the local launcher chooses it: a rank whose own code
raised, then a rank that died without a word, then a rank that lost a peer,
then a rank the driver itself aborted; earlier arrival breaks ties.  Cleanup
(abort frame to every task, job cancel, log server close) runs in `finally`.
"""
from __future__ import annotations

import base64
import dataclasses
import functools
import os
import re
import sys
import uuid
from typing import Mapping, Optional, Tuple

from collectives.launch.procs import failure_text, signal_name
from collectives.errors import describe

from . import checks
from .logchannel import LineSink, LogServer, parse_failure_markers
from .pickling import code_files, pickle_job, restore_frames
from .settings import DriverSettings
from .watch import Watch
from ..progress import ENABLED as _PROGRESS_ENV
from ..progress import PROGRESS_MARK, Tracked

__all__ = ["JobFailedError", "run_on_spark", "run_on_driver", "JobOptions"]

GRACE = 1.0          # seconds to wait for the root cause while only lost-peer errors are in
SHORT_GRACE = 0.25   # ... while the best record is a rank that died without a word
DRAIN = 5.0          # seconds to wait for the last output lines of every rank
_COMM_ERRORS = ("PeerLostError", "CollectiveTimeout")
_DEATHS = ("ProcessDied", "ProcessExited", "SparkTaskFailed")


class JobFailedError(RuntimeError):
    """A rank failed; names it, its error or exit status, its traceback and last output."""

    def __init__(self, record: dict, attempt: int = 0, attempts: int = 1,
                 files: Optional[Mapping[str, str]] = None) -> None:
        if files and record.get("traceback"):
            record = dict(record, traceback=restore_frames(record["traceback"], files))
        if record.get("tail"):  # progress records are for the bar, not for the reader
            record = dict(record, tail=[ln for ln in record["tail"] if PROGRESS_MARK not in ln])
        self.record = record
        self.rank: Optional[int] = record.get("rank")
        self.size: Optional[int] = record.get("size")
        self.host: Optional[str] = record.get("host")
        self.exitcode: Optional[int] = record.get("exitcode")
        self.error_type: str = record.get("error_type", "JobFailed")
        self.error_message: str = record.get("message", "")
        self.remote_traceback: str = record.get("traceback") or ""
        self.output_tail: str = "\n".join(record.get("tail") or [])
        self.attempt, self.attempts = attempt, attempts
        super().__init__(self._text())

    def __reduce__(self):
        # the record is already restored and filtered: rebuild from it, so a run() called in
        # a subprocess or a worker pool hands its caller this error, not an unpickling one
        return type(self), (self.record, self.attempt, self.attempts)

    @property
    def signal(self) -> Optional[str]:
        """The name of the signal that killed the rank, if one did."""
        return signal_name(self.exitcode)

    def _hint(self) -> Optional[str]:
        if self.signal == "SIGKILL":
            return "SIGKILL often means the OOM killer; check the executor's memory"
        return self.record.get("hint")

    def _text(self) -> str:
        what = f"{self.error_type}: {self.error_message}"
        op = "job" if self.attempts == 1 else f"job attempt {self.attempt + 1}/{self.attempts}"
        text = describe(what, op=op, rank=self.rank, size=self.size,
                        address=f"host {self.host}" if self.host else None, hint=self._hint())
        who = "the job" if self.rank is None else f"rank {self.rank}"
        return failure_text(text, who, self.remote_traceback, self.output_tail)

    def original(self) -> Optional[BaseException]:
        """The rank's own exception object, where it could be pickled and unpickled here."""
        blob = self.record.get("exc_blob")
        if not blob:
            return None
        try:
            import cloudpickle

            return cloudpickle.loads(base64.b64decode(blob))
        except Exception:
            return None


# --------------------------------------------------------------------------- failures

def _priority(record: dict) -> int:
    if record.get("aborted"):
        return 3
    if record.get("error_type") in _COMM_ERRORS:
        return 2
    if record.get("error_type") in _DEATHS:
        return 1
    return 0


def root_cause(records: list) -> dict:
    """The record that explains the failure (see the module docstring)."""
    seen, unique = set(), []
    for rec in records:
        if rec.get("rank") not in seen:
            seen.add(rec.get("rank"))
            unique.append(rec)
    return min(enumerate(unique), key=lambda ir: (_priority(ir[1]), ir[0]))[1]


_BARRIER_TASK = re.compile(r"barrier task ResultTask\(\d+, (\d+)\) finished unsuccessfully")


def _spark_record(text: str, np_: int) -> dict:
    """A record for a failure no rank reported: a crashed task, a lost executor, Spark itself."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("\t")]
    lines = [ln.lstrip(": ") for ln in lines if not ln.startswith("An error occurred while calling")]
    task = _BARRIER_TASK.search(text)
    # Spark's headline says "stage failure"; the line after it says why (the crash, the loss)
    cause = next((ln for ln in lines[1:] if "Exception" in ln or "Error" in ln), None)
    message = cause or (lines[0] if lines else "unknown Spark failure")
    rec = {"rank": int(task.group(1)) if task else None, "size": np_,
           "error_type": "SparkTaskFailed" if task else "SparkJobFailed",
           "message": message[:2000], "hint": "the task itself failed, not the training function; "
                                              "see the executor's log"}
    if "maxResultSize" in text:
        rec.update(error_type="ResultTooLarge", hint="the ranks' results together are over "
                   "spark.driver.maxResultSize; return less (a path to a saved model) or raise it")
    return rec


def failure_of(server: Optional[LogServer], exc: BaseException, np_: int) -> dict:
    """The root cause of a failed attempt, from the log channel and Spark's exception text."""
    text = str(exc)
    spark = _spark_record(text, np_)
    known = parse_failure_markers(text) + ([spark] if spark["rank"] is not None else [])
    if server is None:
        return root_cause(known) if known else spark

    def best() -> int:
        return min((_priority(r) for r in list(server.failures) + known), default=9)

    server.wait(lambda: len(server.failures) >= np_ or best() <= 1, GRACE)
    server.wait(lambda: len(server.failures) >= np_ or best() == 0,
                SHORT_GRACE if best() == 1 else 0)
    records = list(server.failures) + known
    return root_cause(records) if records else spark


# --------------------------------------------------------------------------- running

@dataclasses.dataclass(frozen=True)
class JobOptions:
    np: int
    env: Tuple[Tuple[str, str], ...] = ()
    stdout: object = None
    stderr: object = None
    show_output: bool = True
    rank0_only: bool = False
    start_timeout: float = 60.0
    verbose: int = 1
    max_restarts: int = 0
    timestamps: bool = False
    executable: Optional[str] = None
    settings: DriverSettings = DriverSettings()  # the driver's switches, read as the job starts
    timeout: Optional[float] = None   # seconds for the whole job (each attempt); None: none

    def say(self, level: int, msg: str) -> None:
        if self.verbose >= level:
            print(f"horovod_spark: {msg}", file=self.stderr or sys.stderr, flush=True)


def _restarting(opts: JobOptions, attempt: int, exc: "JobFailedError") -> bool:
    if attempt >= opts.max_restarts:
        return False
    opts.say(1, f"attempt {attempt + 1}/{opts.max_restarts + 1} failed "
                f"({exc.error_type} on rank {exc.rank}); restarting every rank")
    return True


def _tracked(fn, opts: JobOptions):
    """The function the ranks run: with the progress step hook when the job shows progress."""
    return Tracked(fn) if set(_PROGRESS_ENV) <= set(opts.env) and callable(fn) else fn


def _payload(fn, args, kwargs, opts: JobOptions) -> bytes:
    tracked = _tracked(fn, opts)
    if tracked is not fn:
        try:
            import cloudpickle

            return cloudpickle.dumps((tracked, tuple(args), dict(kwargs or {})))
        except Exception:
            pass  # pickle_job says which part cannot be pickled
    return pickle_job(fn, args, kwargs)


def run_on_driver(fn, args, kwargs, opts: JobOptions) -> list:
    """-np ranks on this machine through collectives.launch; no Spark tasks."""
    from collectives.launch import RankFailed, run_local

    pickle_job(fn, args, kwargs)  # the same clear error as on Spark
    size = -opts.np
    for attempt in range(opts.max_restarts + 1):
        try:
            return run_local(_tracked(fn, opts), size, args=args, kwargs=kwargs, env=dict(opts.env),
                             stdout=opts.stdout, stderr=opts.stderr, timeout=opts.timeout)
        except RankFailed as exc:
            rec = {"rank": exc.rank, "size": size, "host": "localhost", "exitcode": exc.exitcode,
                   "error_type": exc.error_type, "message": exc.message,
                   "traceback": exc.remote_traceback, "tail": exc.output_tail.splitlines(),
                   "exc_blob": base64.b64encode(exc.exc_blob or b"").decode()}
            err = JobFailedError(rec, attempt, opts.max_restarts + 1, code_files(fn))
            if not _restarting(opts, attempt, err):
                raise err from None
    raise AssertionError("unreachable")


def _checks_before_submit(sc, opts: JobOptions) -> int:
    conf = sc.getConf()
    checks.check_dynamic_allocation(conf, sc.master)
    checks.check_gpus(conf, opts.np, warn=lambda m: opts.say(1, f"warning: {m}"))
    checks.wait_for_slots(sc, opts.np, opts.start_timeout, say=lambda m: opts.say(1, m))
    return checks.max_result_size(conf)


def _log_server(sc, secret: bytes, job: str, opts: JobOptions) -> Optional[LogServer]:
    sink = LineSink(opts.stdout, opts.stderr, opts.show_output, opts.timestamps)
    host = sc.getConf().get("spark.driver.host", "127.0.0.1")
    try:
        return LogServer(host, secret, job, sink)
    except OSError as exc:  # a broken log channel never fails a job
        opts.say(1, f"warning: no live output: cannot listen on the driver address {host}: {exc}")
        return None


def job_store(sc, secret: bytes, opts: JobOptions):
    """The attempt's rendezvous store on the driver (see _spark_store), or None: the tasks
    then meet through Spark's allGather (HOROVOD_SPARK_RENDEZVOUS=spark, or no listening)."""
    from collectives.rendezvous.store import StoreServer

    if opts.settings.rendezvous == "spark":
        return None
    host = sc.getConf().get("spark.driver.host", "127.0.0.1")
    try:
        return StoreServer(host, 0, secret)
    except OSError as exc:
        opts.say(1, f"warning: ranks meet through Spark's allGather (about a second more): "
                    f"cannot listen on the driver address {host}: {exc}")
        return None


def run_on_spark(spark, fn, args, kwargs, opts: JobOptions) -> list:
    """One barrier stage of opts.np tasks per attempt; every rank's value in rank order."""
    sc = spark.sparkContext
    limit = _checks_before_submit(sc, opts)
    payload = _payload(fn, args, kwargs, opts)
    secret, job_id = os.urandom(32), f"hvs-{uuid.uuid4().hex[:12]}"
    for attempt in range(opts.max_restarts + 1):
        if attempt:
            checks.wait_for_slots(sc, opts.np, opts.start_timeout, say=lambda m: opts.say(1, m))
        try:
            return _attempt(sc, payload, secret, f"{job_id}/a{attempt}", limit, opts, attempt,
                            code_files(fn))
        except JobFailedError as err:
            if not _restarting(opts, attempt, err):
                raise
    raise AssertionError("unreachable")


def _attempt(sc, payload: bytes, secret: bytes, job: str, limit: int, opts: JobOptions,
             attempt: int, files: Mapping[str, str]) -> list:
    from .task import TaskSpec, run_task

    server = _log_server(sc, secret, job, opts)
    store = job_store(sc, secret, opts)
    spec = TaskSpec(job=job, secret=secret, payload=payload,
                    log_address=server.address if server else None, env=opts.env,
                    show_output=opts.show_output, rank0_only=opts.rank0_only,
                    result_limit=limit, executable=opts.executable,
                    warm=opts.settings.warm_start,
                    job_store=store.address if store else None)
    tag = f"horovod-spark-{job.replace('/', '-')}"
    opts.say(2, f"{job}: {opts.np} ranks on {sc.master}")
    sc.addJobTag(tag)
    ok = False
    watch = Watch(opts.np, server, lambda: _cancel(sc, server, tag), opts.timeout,
                  opts.settings.finish_grace)
    try:
        rdd = sc.parallelize(range(opts.np), opts.np).barrier()
        rows = rdd.mapPartitions(functools.partial(run_task, spec)).collect()
        ok = True
    except Exception as exc:  # py4j's Py4JJavaError and friends: Spark's account of the failure
        watch.close()
        record = watch.record or failure_of(server, exc, opts.np)
        raise JobFailedError(record, attempt, opts.max_restarts + 1, files) from None
    finally:
        watch.close()
        _finish(sc, server, tag, ok, opts.np, store)
    return _values(rows, opts)


def _cancel(sc, server: Optional[LogServer], tag: str) -> None:
    """The watch ends the attempt: its ranks die now, its Spark job is cancelled."""
    if server is not None:
        server.abort_all()
    sc.cancelJobsWithTag(tag)


def _finish(sc, server: Optional[LogServer], tag: str, ok: bool, np_: int, store=None) -> None:
    try:
        if not ok:
            sc.cancelJobsWithTag(tag)
        sc.removeJobTag(tag)
    finally:
        try:
            if server is not None:
                if ok:
                    server.wait_done(range(np_), DRAIN)
                else:  # kill the ranks still running now, not when Spark gets to it
                    server.abort_all()
                    server.wait_disconnected(DRAIN)
                server.close()
        finally:
            if store is not None:
                store.close()


def _values(rows, opts: JobOptions) -> list:
    import cloudpickle

    by_rank = dict(rows)
    if sorted(by_rank) != list(range(opts.np)):
        raise JobFailedError({"rank": None, "size": opts.np, "error_type": "SparkJobFailed",
                              "message": f"results came back for ranks {sorted(by_rank)}"})
    wanted = [0] if opts.rank0_only else range(opts.np)
    return [cloudpickle.loads(by_rank[r])[1] for r in wanted]
