"""How a failed job is explained on the driver: `JobFailedError` and where its failure comes from.

A failed attempt is explained by the ranks' failures (`collectives.launch.record.Failure`),
which arrive on the log channel and inside Spark's exception text, and by
Spark's own account when no rank said anything (a crashed task, a lost
executor).  The root cause is `record.root_cause`'s, the rule the local
launcher uses too.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Mapping, Optional, Union

from collectives.errors import describe
from collectives.launch import RankFailed
from collectives.launch.record import Failure, failure_text, root_cause, signal_name

from ..progress import PROGRESS_MARK
from .logchannel import LogServer
from .markers import parse_failure_markers
from .pickling import restore_frames

__all__ = ["JobFailedError", "failure_of", "spark_failure"]

GRACE = 1.0          # seconds to wait for the root cause while only lost-peer errors are in
SHORT_GRACE = 0.25   # ... while the best record is a rank that died without a word
_RANKS = {"own": 0, "death": 1, "comm": 2, "aborted": 3}


class JobFailedError(RankFailed):
    """A rank failed; names it, its error or exit status, its traceback and last output."""

    def __init__(self, failure: Union[Failure, Mapping], attempt: int = 0, attempts: int = 1,
                 files: Optional[Mapping[str, str]] = None) -> None:
        if not isinstance(failure, Failure):
            failure = Failure.from_dict(failure)
        if files and failure.traceback:
            failure = dataclasses.replace(failure,
                                          traceback=restore_frames(failure.traceback, files))
        if failure.tail:  # progress records are for the bar, not for the reader
            failure = dataclasses.replace(failure, tail=tuple(ln for ln in failure.tail
                                                   if PROGRESS_MARK not in ln))
        self.attempt, self.attempts = attempt, attempts
        super().__init__(failure)

    def __reduce__(self):
        return (type(self), (self.failure, self.attempt, self.attempts))

    size = property(lambda self: self.failure.size)
    host = property(lambda self: self.failure.host)
    error_message = property(lambda self: self.failure.message)
    record = property(lambda self: self.failure.to_dict())

    @property
    def signal(self) -> Optional[str]:
        """The name of the signal that killed the rank, if one did."""
        return signal_name(self.exitcode)

    def _hint(self) -> Optional[str]:
        if self.signal == "SIGKILL":
            return "SIGKILL often means the OOM killer; check the executor's memory"
        return self.failure.hint

    def _text(self) -> str:
        f = self.failure
        what = f"{f.error_type}: {f.message}"
        op = "job" if self.attempts == 1 else f"job attempt {self.attempt + 1}/{self.attempts}"
        if f.reported_by is not None:
            op += f", reported by rank {f.reported_by}"
        text = describe(what, op=op, rank=f.rank, size=f.size,
                        address=f"host {f.host}" if f.host else None, hint=self._hint())
        return failure_text(text, self._who(), f.traceback, "\n".join(f.tail))


_BARRIER_TASK = re.compile(r"barrier task ResultTask\(\d+, (\d+)\) finished unsuccessfully")
# Spark's words for a lost executor, kept verbatim: "ExecutorLostFailure (executor 1 exited
# caused by one of the running tasks) Reason: Command exited with code 137"
_EXECUTOR_LOST = re.compile(r"ExecutorLostFailure \(executor (\S+)[^\n]*")
_EXECUTOR_DIED = ("the executor's JVM died (exit code 137 is SIGKILL: often the OOM killer or "
                  "the cluster manager; check its memory and its Worker's log)")
_WORKER_LOST = ("the cluster manager lost the Worker on that host, and its executors with it "
                "(the Worker's process died, or its host or network went down); check that host")
_TASK_HOST = re.compile(r"\(([^\s()]+) executor \S+\)")


def spark_failure(text: str, np_: int) -> Failure:
    """A failure no rank reported: a crashed task, a lost executor, Spark itself."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("\t")]
    lines = [ln.lstrip(": ") for ln in lines if not ln.startswith("An error occurred while calling")]
    task = _BARRIER_TASK.search(text)
    # Spark's headline says "stage failure"; the line after it says why (the crash, the loss)
    cause = next((ln for ln in lines[1:] if "Exception" in ln or "Error" in ln), None)
    message = cause or (lines[0] if lines else "unknown Spark failure")
    lost = _EXECUTOR_LOST.search(text)
    if lost:
        where = _TASK_HOST.search(text)
        return Failure(int(task.group(1)) if task else None, "ExecutorLost",
                       f"executor {lost.group(1)} was lost: {lost.group(0).strip()[:1000]}",
                       size=np_, host=where.group(1) if where else None,
                       hint=_WORKER_LOST if "worker lost" in lost.group(0) else _EXECUTOR_DIED)
    if "maxResultSize" in text:
        return Failure(int(task.group(1)) if task else None, "ResultTooLarge", message[:2000],
                       size=np_, hint="the ranks' results together are over "
                       "spark.driver.maxResultSize; return less (a path to a saved model) or raise it")
    return Failure(int(task.group(1)) if task else None,
                   "SparkTaskFailed" if task else "SparkJobFailed", message[:2000], size=np_,
                   hint="the task itself failed, not the training function; see the executor's log")


def failure_of(server: Optional[LogServer], exc: BaseException, np_: int) -> Failure:
    """The root cause of a failed attempt, from the log channel and Spark's exception text."""
    text = str(exc)
    spark = spark_failure(text, np_)
    if server is not None and spark.rank is not None and not spark.host:
        spark = dataclasses.replace(spark, host=server.hosts.get(spark.rank))  # where its task ran
    known = [Failure.from_dict(r) for r in parse_failure_markers(text)]
    if spark.rank is not None:
        known.append(spark)
    if server is None:
        return root_cause(known) if known else spark

    def arrived() -> list:
        return [Failure.from_dict(r) for r in list(server.failures)] + known

    def best() -> int:
        return min((_RANKS[f.kind] for f in arrived()), default=9)

    server.wait(lambda: len(server.failures) >= np_ or best() <= 1, GRACE)
    server.wait(lambda: len(server.failures) >= np_ or best() == 0,
                SHORT_GRACE if best() == 1 else 0)
    records = arrived()
    failed = {f.rank for f in records}
    finished = [r for r in server.done if r not in failed]  # their task said done, no failure
    return root_cause(records, finished) if records else spark
