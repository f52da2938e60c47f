"""The driver side of a fit: one barrier stage over the DataFrame's partitions.

The Spark runner runs a function as a barrier stage of its own
(``spark.range(np)`` through a barrier ``mapInArrow``).  A fit needs the ranks inside the
barrier stage *of the data*, so that each task hands its partition to its rank
without any copy through shared storage.  So a fit hands the job machinery's
``BarrierJob`` (pre-submit checks, secret, log server, job store, failure
analysis, cleanup) a different stage: its task body (``_barrier.task_body``
runs the job's task on a thread while it spills).  The stage itself is
``prepared_df.mapInArrow(task_body, barrier=True)``, planned and submitted under
``data.TRANSFER_CONF`` (no byte cap per Arrow batch, so the JVM does not size each
batch row by row; the session's own values come back after the submit).

The prepared DataFrame is repartitioned to ``num_proc`` only when it has another
number of partitions.  If its own partitions leave a rank with no rows, or Spark
refuses a barrier stage over them (partitions made by a union or a coalesce in
the same stage), the fit runs once more after a repartition (round-robin, so
every rank gets rows, and the stage starts from the shuffle).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict, NamedTuple, Optional

from horovod_spark.estimator._barrier import RESULT_SCHEMA, task_body
from horovod_spark.estimator._census import EMPTY, OK, PROBLEM
from horovod_spark.estimator._job import FitJob
from horovod_spark.estimator.data import transfer_conf
from horovod_spark._job import is_connect

__all__ = ["run_fit"]

# Spark refuses a barrier stage whose partitions come from a union, coalesce, ...
_CHAIN = "BarrierJobUnsupportedRDDChainException"


def run_fit(spark, prepared_df, num_proc: int, job: FitJob, verbose: int = 1
            ) -> Dict[str, Any]:
    """Rank 0's result of the fit: {"model": bytes, "history": ..., "timings": ...}."""
    as_is = partitions(prepared_df) == num_proc
    df = prepared_df if as_is else prepared_df.repartition(num_proc)
    try:
        status, payload = _stage(spark, df, num_proc, job, verbose)
    except Exception as exc:
        if not (as_is and _CHAIN in str(exc)):
            raise
        status, payload = EMPTY, "its partitions come from a union or coalesce, which a " \
                                 "barrier stage can't start from"
    if status == EMPTY and as_is:
        if verbose:
            print(f"horovod_spark: the DataFrame's {num_proc} partitions can't be the ranks' "
                  f"shards as they are: {payload}; repartitioning", flush=True)
        status, payload = _stage(spark, prepared_df.repartition(num_proc), num_proc, job, verbose)
    if status != OK:
        hint = "" if status == PROBLEM else \
            "; the DataFrame needs at least one training row per rank: fewer ranks or more rows"
        raise ValueError(f"{payload}{hint}")
    return payload


def partitions(df) -> Optional[int]:
    """The DataFrame's partition count if Spark knows it without running a job, else None.

    ``df.rdd.getNumPartitions()`` would run the shuffles under an adaptive plan;
    the physical plan before adaptive execution knows the count of a repartition,
    a range, a join or a cached DataFrame, and a plan without a shuffle (a file
    scan, local data) is cheap to ask.
    """
    try:
        plan = df._jdf.queryExecution().sparkPlan()
        known = int(plan.outputPartitioning().numPartitions())
        if known > 0:
            return known
        if "Exchange" in plan.toString():
            return None
    except Exception:  # not a classic DataFrame: ask the RDD
        pass
    if is_connect(df):  # no plan or RDD here: repartition to be sure
        return None
    return df.rdd.getNumPartitions()


class FitRow(NamedTuple):
    """One task's row of the fit's barrier stage (_barrier.RESULT_SCHEMA)."""
    partition: int
    status: str
    message: str
    payload: bytes    # rank 0's result once its task is OK (through the job store or not)


def _stage(spark, df, num_proc: int, job: FitJob, verbose: int):
    """(status, rank 0's result or the problem) of one barrier stage."""

    from horovod_spark import progress
    from horovod_spark._job import BarrierJob, JobOptions, displayed, failure_logs_off, value_of

    opts = JobOptions.of(num_proc, rank0_only=True, verbose=verbose, show_output=verbose > 0)

    with displayed(opts) as (opts, display):  # the progress bar, from the ranks' records
        if display.enabled:  # the loops report each step themselves (progress.report)
            job = dataclasses.replace(job, train_fn=progress.Tracked(job.train_fn))

        def stage(spec, delivered):
            body = functools.partial(task_body, spec, job)
            with transfer_conf(spark):  # planned and submitted with the transfer's confs
                rows = df.mapInArrow(body, RESULT_SCHEMA, barrier=True).collect()
            # rank 0's result (the model) may have gone home through the job store
            return [FitRow(r.partition, r.status, r.message,
                           delivered(0, r.payload) if r.partition == 0 and r.status == OK
                           else r.payload) for r in rows]

        with failure_logs_off(None if is_connect(spark) else spark.sparkContext):
            rows = BarrierJob(spark, opts, name="hvs-fit").attempt(0, b"", stage)
    for row in sorted(rows, key=lambda r: r.partition):
        if row.status != OK:
            return row.status, row.message
    blob = next(row.payload for row in rows if row.partition == 0)
    value = value_of(0, blob, opts.np)
    return value["problem"] if "problem" in value else (OK, value)
