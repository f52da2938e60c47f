"""The driver side of a job: one face, `BarrierJob`, for the runner, the CLI and the estimators.

Terms.  A *job* is one call of `run` / `HorovodRunner.run` / `fit`; an
*attempt* is one barrier stage of it (`max_restarts` adds attempts after a
failure).  The *payload* is the cloudpickle of (fn, args, kwargs).  Each
attempt has its own key prefix (`<job id>/a<attempt>`), log server and job
store; the job has one secret (its ranks') and one task key (its tasks' and the
driver's alone: the log server and job store take it).  A `BarrierJob` checks the cluster before it
submits (slots, GPU amounts, dynamic allocation), runs each attempt's stage
with the task spec it built, turns a failed stage into one `JobFailedError`
naming the root cause (see `failure`), and cleans up in `finally` (abort frame
to every task, job cancel, log server and store closed).  The stage itself is
the caller's: the runner's is `spark.range(np, numPartitions=np)` through a
barrier `mapInArrow` (see `cluster`); a fit's is the DataFrame's own partitions,
through `mapInArrow(..., barrier=True)`.  Both run on classic and Spark Connect
sessions: what the job asks of its session goes through `cluster.Cluster`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import uuid
from typing import Callable, Iterable, Mapping, Optional

from . import checks
from .failure import JobFailedError, failure_of
from .logchannel import LineSink, LogServer
from .pickling import code_files, pickle_job
from .quiet import failure_logs_off
from ..settings import driver_only
from .options import JobOptions
from .watch import Watch
from .task import TaskSpec, run_task
from .warm import session_token
from .._autoload import Armed
from ..progress import ENABLED as _PROGRESS_ENV
from ..progress import Tracked

__all__ = ["JobFailedError", "JobOptions", "BarrierJob", "run_on_spark", "run_on_driver", "value_of"]

DRAIN = 5.0          # seconds to wait for the last output lines of every rank


def _restarting(opts: JobOptions, attempt: int, exc: JobFailedError) -> bool:
    if attempt >= opts.max_restarts:
        return False
    opts.say(1, f"attempt {attempt + 1}/{opts.max_restarts + 1} failed "
                f"({exc.error_type} on rank {exc.rank}); restarting every rank")
    return True


def _tracked(fn, opts: JobOptions):
    """The function the ranks run: torch.distributed's "hvs" backend registered first (see
    `_autoload`), with the progress step hook when the job shows progress."""
    if not callable(fn):
        return fn
    return Armed(Tracked(fn) if set(_PROGRESS_ENV) <= set(opts.env) else fn)


def payload_of(fn, args, kwargs, opts: JobOptions) -> bytes:
    """The job's payload; a clear error naming the part that cannot be pickled."""
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
            failure = dataclasses.replace(exc.failure, size=size,
                                          host=exc.failure.host or "localhost")
            err = JobFailedError(failure, attempt, opts.max_restarts + 1, code_files(fn))
            if not _restarting(opts, attempt, err):
                raise err from None
    raise AssertionError("unreachable")


class BarrierJob:
    """One job on Spark: checks, secret, and for each attempt its log server, store and stage."""

    def __init__(self, spark, opts: JobOptions, files: Optional[Mapping[str, str]] = None,
                 name: str = "hvs") -> None:
        self.spark, self.opts, self.files = spark, opts, dict(files or {})
        from .cluster import Cluster

        self.cluster = Cluster(spark, opts.settings.client_address or "")
        self.result_limit = self._checks_before_submit()
        self.secret, self.task_key = os.urandom(32), os.urandom(32)
        self.id = f"{name}-{uuid.uuid4().hex[:12]}"
        self.keeper = None  # an elastic job's: what each attempt's store starts with and keeps

    def resize(self, np_: int) -> None:
        """Run the next attempts with np_ ranks (an elastic job, between attempts)."""
        self.opts = dataclasses.replace(self.opts, np=np_)

    def _checks_before_submit(self) -> int:
        cluster, opts = self.cluster, self.opts
        checks.check_dynamic_allocation(cluster.conf, cluster.master)
        checks.check_gpus(cluster.conf, opts.np, warn=lambda m: opts.say(1, f"warning: {m}"))
        checks.wait_for_slots(cluster, opts.np, opts.start_timeout, say=lambda m: opts.say(1, m))
        return checks.max_result_size(cluster.conf)

    def run(self, payload: bytes, stage: Optional[Callable[..., Iterable]] = None,
            **spec_fields) -> list:
        """Every attempt's stage until one succeeds or `max_restarts` is spent; its rows."""
        opts = self.opts
        for attempt in range(opts.max_restarts + 1):
            if attempt:
                checks.wait_for_slots(self.cluster, opts.np, opts.start_timeout,
                                      say=lambda m: opts.say(1, m))
            try:
                with failure_logs_off(self.cluster.sc):  # the JobFailedError says it all, once
                    return self.attempt(attempt, payload, stage, **spec_fields)
            except JobFailedError as err:
                if not _restarting(opts, attempt, err):
                    raise
        raise AssertionError("unreachable")

    def attempt(self, attempt: int, payload: bytes,
                stage: Optional[Callable[..., Iterable]] = None, **spec_fields) -> list:
        """One barrier stage: `stage(spec, delivered)` returns its collected rows (default:
        the runner's); `delivered(rank, blob)` is the rank's encoded result, read from the job
        store where its task delivered it there (its row then holds b"")."""
        opts, cluster = self.opts, self.cluster
        job = f"{self.id}/a{attempt}"
        server = self._log_server(job)
        store = self._job_store()
        if self.keeper is not None:
            try:
                self.keeper.seed(store, job, attempt, opts.np)
            except BaseException:
                for opened in (server, store):
                    if opened is not None:
                        opened.close()
                raise
        fields = dict(env=opts.env, show_output=opts.show_output, rank0_only=opts.rank0_only,
                      executable=opts.executable, warm=opts.settings.warm_start,
                      torch_layout=opts.torch_layout, zygote_token=session_token(),
                      driver_only=driver_only(dict(opts.env)))
        fields.update(spec_fields)
        spec = TaskSpec(job=job, secret=self.secret, task_key=self.task_key, payload=payload,
                        log_address=server.address if server else None,
                        result_limit=self.result_limit,
                        job_store=store.address if store else None, **fields)
        tag = f"horovod-spark-{job.replace('/', '-')}"
        opts.say(2, f"{job}: {opts.np} ranks on {cluster.master} ({cluster.kind})")
        cluster.tag(tag)
        ok = False
        watch = Watch(opts.np, server, lambda: self._cancel(server, tag), opts.timeout,
                      opts.settings.finish_grace)
        try:
            rows = (stage or self._runner_stage)(spec, functools.partial(_delivered, store, job))
            ok = True
            return rows
        except Exception as exc:  # py4j's Py4JJavaError, Connect's SparkException: Spark's account
            watch.close()
            failure = watch.record or self._jvm_death(exc) or failure_of(server, exc, opts.np)
            raise JobFailedError(failure, attempt, opts.max_restarts + 1, self.files) from None
        finally:
            watch.close()
            self._finish(server, tag, ok, store, job)

    def _runner_stage(self, spec: TaskSpec, delivered: Callable[[int, bytes], bytes]) -> list:
        rows = self.cluster.barrier_rows(self.opts.np, functools.partial(run_task, spec))
        return [row._replace(result=delivered(row.rank, row.result)) for row in rows]

    def _log_server(self, job: str) -> Optional[LogServer]:
        """The live output's server on the client's address, or None (the executors cannot
        reach this process: each rank's lines come back with its result instead)."""
        opts, host = self.opts, self.cluster.client_host
        if host is None:
            self.cluster.tell_once(
                f"no live output: the executors of this {self.cluster.kind} session cannot reach "
                f"this process; each rank's output comes back with its result",
                lambda m: opts.say(1, m))
            return None
        sink = LineSink(opts.stdout, opts.stderr, opts.show_output, opts.timestamps)
        try:
            return LogServer(host, self.task_key, job, sink)
        except OSError as exc:  # a broken log channel never fails a job
            opts.say(1, f"warning: no live output: cannot listen on the client address {host}: {exc}")
            return None

    def _job_store(self):
        """The attempt's rendezvous store on the client (see spark_store), or None: the tasks
        then meet at rank 0's through Spark's allGather (HOROVOD_SPARK_RENDEZVOUS=spark, a
        Connect client the executors may not reach, or no listening)."""
        from collectives.rendezvous.store import StoreServer

        if self.opts.settings.rendezvous == "spark" or not self.cluster.reachable:
            return None
        host = self.cluster.client_host
        try:
            return StoreServer(host, 0, self.task_key)
        except OSError as exc:
            self.opts.say(1, f"warning: ranks meet through Spark's allGather (about a second "
                             f"more): cannot listen on the client address {host}: {exc}")
            return None

    def _cancel(self, server: Optional[LogServer], tag: str) -> None:
        """The watch ends the attempt: its ranks die now, its Spark job is cancelled."""
        if server is not None:
            server.abort_all()
        self.cluster.cancel(tag)

    def _jvm_death(self, exc: BaseException):
        """A failure saying the driver's JVM died, when it did (py4j cannot reach it)."""
        from collectives.launch.record import Failure

        if self.cluster.connect:  # no JVM here: the server's failures come in Spark's text
            return None
        try:
            self.cluster.sc._jsc.sc().isStopped()  # any call: a dead JVM refuses the connection
            return None
        except Exception:
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            return Failure(None, "SparkDriverDied", f"the Spark driver JVM died while the job "
                           f"ran ({type(exc).__name__}: {first})", size=self.opts.np,
                           hint="see the driver's log; often out of memory: raise "
                                "spark.driver.memory, or return less from the function")

    def _finish(self, server: Optional[LogServer], tag: str, ok: bool, store, job: str) -> None:
        """Cancel, close, kill what is left; a cleanup that fails never hides the job's
        outcome (the JVM may be the thing that died)."""
        np_ = self.opts.np
        try:
            self.cluster.untag(tag, cancel=not ok)
        except Exception as exc:  # py4j's errors when the JVM is gone
            self.opts.say(2, f"cleanup: Spark did not answer ({type(exc).__name__}: {exc})")
        finally:
            with contextlib.ExitStack() as stack:
                if store is not None:
                    stack.callback(store.close)
                    if self.keeper is not None:  # after the ranks are gone, before the close
                        stack.callback(self.keeper.keep, store, job)
                if server is not None:
                    stack.callback(server.close)
                    if ok:
                        server.wait_done(range(np_), DRAIN)
                    else:  # kill the ranks still running now, not when Spark gets to it
                        server.abort_all()
                        server.wait_disconnected(DRAIN)

    def values(self, rows) -> list:
        """The runner stage's rows as every rank's value in rank order (rank 0's alone with
        rank0_only)."""
        from collectives.launch.record import Failure

        self.show_returned_output(rows)
        by_rank = {row.rank: row.result for row in rows}
        np_ = self.opts.np
        if sorted(by_rank) != list(range(np_)):
            raise JobFailedError(Failure(None, "SparkJobFailed",
                                         f"results came back for ranks {sorted(by_rank)}", size=np_))
        wanted = [0] if self.opts.rank0_only else range(np_)
        return [value_of(r, by_rank[r], np_) for r in wanted]


    def show_returned_output(self, rows) -> None:
        """The output lines that came back with the results (no live channel), in rank order."""
        import json

        opts = self.opts
        sink = LineSink(opts.stdout, opts.stderr, opts.show_output, opts.timestamps)
        for row in sorted(rows, key=lambda r: r.rank):
            for stream, text in json.loads(row.output) if row.output else ():
                sink.write(row.rank, stream, text)


def value_of(rank: int, blob: bytes, np_: int):
    """Rank `rank`'s value from its encoded result; JobFailedError naming the rank where it
    cannot be loaded here."""
    from collectives.launch import RankFailed
    from collectives.launch.procs import loaded
    from collectives.launch.record import RankResult

    try:
        return loaded(rank, RankResult.decode(blob))
    except RankFailed as exc:
        raise JobFailedError(dataclasses.replace(exc.failure, size=np_)) from None


def _delivered(store, job: str, rank: int, blob: Optional[bytes]) -> Optional[bytes]:
    """A rank's encoded result: the row's, or the one its task delivered to the job store
    (the row holds b""; see `spark_store.SparkStore.deliver`)."""
    from .task import delivered_key

    if blob != b"" or store is None:
        return blob
    key = delivered_key(job, rank)
    try:
        return store.get(key, 5.0)
    finally:
        store.delete(key)


def run_on_spark(spark, fn, args, kwargs, opts: JobOptions) -> list:
    """One barrier stage of opts.np tasks per attempt; every rank's value in rank order."""
    job = BarrierJob(spark, opts, code_files(fn))
    return job.values(job.run(payload_of(fn, args, kwargs, opts)))
