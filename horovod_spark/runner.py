"""The two ways to launch: Databricks' HorovodRunner and horovod.spark.run.

    HorovodRunner(np=4).run(train, epochs=3)      # rank 0's return value
    horovod_spark.run(train, args=(3,), num_proc=4)  # every rank's value, in rank order

np > 0 runs one barrier stage of np Spark tasks, one rank each; np < 0 runs
-np ranks on the driver machine with no Spark tasks (for debugging).  With no
active SparkSession an embedded local one is started (see `_session`).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

from ._job import (Cluster, JobFailedError, JobOptions, checks, get_session, job_timeout,
                   launch, start_timeout as _start_timeout)

__all__ = ["HorovodRunner", "run", "run_elastic", "JobFailedError"]

_VERBOSITY = ("all", "log_callback_only")


def _positional(args) -> tuple:
    if isinstance(args, (str, bytes)) or not isinstance(args, (tuple, list)):
        raise TypeError(f"run: args must be a tuple or list of positional arguments for fn, got "
                        f"{type(args).__name__} {args!r:.60}; for one argument write args=(x,)")
    return tuple(args)


class HorovodRunner:
    """Runs a training function as `np` ranks, as Databricks' HorovodRunner does.

    Args:
        np: ranks to run: np > 0 as Spark barrier tasks; np < 0 as -np processes on the
            driver, without Spark tasks (for debugging).
        driver_log_verbosity: "log_callback_only" (Databricks' default) shows only what
            the ranks send with `horovod_spark.log_to_driver`; "all" streams every line of
            every rank's stdout and stderr, prefixed `[rank]<stdout>:`.
        verbose: 0 hides the progress bar (see `horovod_spark.progress`).
        timeout: seconds the whole job may run (None: no limit); past it the job fails with
            JobTimeout.  A constructor argument, since every keyword of run() goes to main.
    """

    def __init__(self, np: int, driver_log_verbosity: str = "log_callback_only",
                 verbose: int = 1, timeout: Optional[float] = None) -> None:
        self.num_processor = checks.check_np(np)
        self.verbose = int(verbose)
        self.timeout = job_timeout(timeout)
        if driver_log_verbosity not in _VERBOSITY:
            raise ValueError(f"driver_log_verbosity must be 'all' or 'log_callback_only', "
                             f"got {driver_log_verbosity!r}")
        self.driver_log_verbosity = driver_log_verbosity

    def run(self, main: Callable[..., Any], **kwargs: Any) -> Any:
        """Run main(**kwargs) as every rank; returns rank 0's value.

        Raises:
            JobFailedError: naming the first failing rank, its error and traceback.
        """
        np_ = self.num_processor
        opts = JobOptions.of(np_, show_output=np_ < 0 or self.driver_log_verbosity == "all",
                             rank0_only=True, verbose=self.verbose, timeout=self.timeout)
        return launch(main, (), kwargs, opts)[0]


def run(fn: Callable[..., Any], args: Sequence = (), kwargs: Optional[Mapping[str, Any]] = None,
        num_proc: Optional[int] = None, start_timeout: Optional[float] = None,
        use_mpi: Optional[bool] = None, use_gloo: Optional[bool] = None,
        extra_mpi_args: Optional[str] = None, env: Optional[Mapping[str, str]] = None,
        stdout=None, stderr=None, verbose: int = 1, nics=None,
        prefix_output_with_timestamp: bool = False, executable: Optional[str] = None,
        max_restarts: int = 0, timeout: Optional[float] = None) -> list:
    """Run fn(*args, **kwargs) as num_proc ranks; returns every rank's value in rank order.

    Compatible with `horovod.spark.run`.  `num_proc` defaults to Spark's default
    parallelism; a negative one runs -num_proc ranks on the driver.  `env` is added to
    each executor's environment; rank output goes to `stdout` / `stderr` (default: the
    driver's).  `use_gloo` and `nics` are accepted and ignored (the native backend binds
    to each task's address).  `max_restarts` reruns every rank after a failure.

    Raises:
        JobFailedError: naming the first failing rank, its error and traceback.
        ValueError: for a cluster that cannot run the job (what to change is in the text).
    """
    args = _positional(args)
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"run: kwargs must be a mapping of keyword arguments for fn, got "
                        f"{type(kwargs).__name__}; pass args=(...) for positional arguments")
    if use_mpi or extra_mpi_args:
        raise ValueError("use_mpi / extra_mpi_args: Spark ranks use the native backend (shared "
                         "memory + TCP) or NCCL, not MPI; for MPI run `horovod-spark run --mpi`")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
    if num_proc is None:
        num_proc = Cluster(get_session()).default_parallelism()
    opts = JobOptions.of(checks.check_np(num_proc), env=env, start_timeout=start_timeout,
                         timeout=timeout, stdout=stdout, stderr=stderr, show_output=True,
                         verbose=int(verbose), max_restarts=max_restarts,
                         timestamps=bool(prefix_output_with_timestamp), executable=executable)
    return launch(fn, tuple(args), dict(kwargs or {}), opts)


def _count(name: str, value, default: int) -> int:
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"run_elastic: {name} must be an int >= 1, got {value!r}")
    return value


def _elastic_sizes(num_proc, min_num_proc, max_num_proc) -> tuple:
    """(num_proc, min, max): min and max default to num_proc, num_proc to max_num_proc, then
    to Spark's default parallelism."""
    if num_proc is None:
        num_proc = max_num_proc if max_num_proc is not None else \
            Cluster(get_session()).default_parallelism()
    num_proc = checks.check_np(num_proc)
    lo = _count("min_num_proc", min_num_proc, abs(num_proc))
    hi = _count("max_num_proc", max_num_proc, max(abs(num_proc), lo))
    if lo > hi:
        raise ValueError(f"run_elastic: min_num_proc={lo} is more than max_num_proc={hi}")
    return num_proc, lo, hi


def run_elastic(fn: Callable[..., Any], args: Sequence = (),
                kwargs: Optional[Mapping[str, Any]] = None, num_proc: Optional[int] = None,
                min_num_proc: Optional[int] = None, max_num_proc: Optional[int] = None,
                start_timeout: Optional[float] = None, elastic_timeout: Optional[float] = None,
                reset_limit: Optional[int] = None, env: Optional[Mapping[str, str]] = None,
                stdout=None, stderr=None, verbose: int = 1, nics=None,
                prefix_output_with_timestamp: bool = False, executable: Optional[str] = None,
                timeout: Optional[float] = None) -> list:
    """Run fn as an elastic job: attempts that resume from the last `state.commit()`.

    Compatible with `horovod.spark.run_elastic`.  Each attempt is one barrier stage of as
    many ranks as there are free slots between `min_num_proc` and `max_num_proc` (both
    default to `num_proc`, which defaults to Spark's default parallelism); a negative
    `num_proc` runs -num_proc local ranks on the driver.  A rank or executor that is lost
    ends the attempt; the next one starts from the last commit (see docs/elastic.md), after
    at most `reset_limit` such resets (None: no limit).  `start_timeout` bounds the wait for
    `min_num_proc` slots before the first attempt, `elastic_timeout` (default: the start
    timeout) before each later one.  `env`, `stdout`, `stderr`, `verbose`, `executable`,
    `timeout` (per attempt) are run()'s.

    Returns:
        Every rank's value of the attempt that returned, in rank order.

    Raises:
        ResetLimitError: the job was reset reset_limit times and failed again; names each
            attempt's failed rank and host.
        NotEnoughSlotsError: fewer than min_num_proc slots after the timeout.
        JobFailedError: the function itself raised (that is not retried).
    """
    from ._job import ElasticOptions

    args = _positional(args)
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"run_elastic: kwargs must be a mapping of keyword arguments for fn, got "
                        f"{type(kwargs).__name__}")
    num_proc, lo, hi = _elastic_sizes(num_proc, min_num_proc, max_num_proc)
    if reset_limit is not None and (isinstance(reset_limit, bool) or
                                    not isinstance(reset_limit, int) or reset_limit < 0):
        raise ValueError(f"run_elastic: reset_limit must be an int >= 0 or None, got "
                         f"{reset_limit!r}")
    opts = JobOptions.of(num_proc, env=env, start_timeout=start_timeout, timeout=timeout,
                         stdout=stdout, stderr=stderr, show_output=True, verbose=int(verbose),
                         max_restarts=reset_limit or 0,
                         timestamps=bool(prefix_output_with_timestamp), executable=executable)
    eopts = ElasticOptions(lo, hi, _start_timeout(elastic_timeout, opts.settings)
                           if elastic_timeout is not None else opts.start_timeout, reset_limit)
    return launch(fn, args, dict(kwargs or {}), opts, eopts)
