"""The driver side of a fit: one barrier stage over the DataFrame's partitions.

The Spark runner (``horovod_spark._job.driver``) runs a function as a barrier stage of
its own (``sc.parallelize(range(np)).barrier()``).  A fit needs the ranks inside
the barrier stage *of the data*, so that each task hands its partition to its
rank without any copy through shared storage.  So this module composes the
runner's parts around a different stage: the runner's pre-submit checks (slots,
dynamic allocation, GPU amounts), its per-job secret and log server (live rank
output, failure records), its task machinery inside our task body
(``_barrier.task_body`` runs ``_task.run_task`` on a thread while it spills), its
failure analysis and its cleanup.  The stage itself is
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
import os
import uuid
from typing import Any, Dict, Optional

from horovod_spark.estimator._barrier import RESULT_SCHEMA, task_body
from horovod_spark.estimator._census import EMPTY, OK, PROBLEM
from horovod_spark.estimator._job import BarrierJob
from horovod_spark.estimator.data import transfer_conf

__all__ = ["run_fit"]

# Spark refuses a barrier stage whose partitions come from a union, coalesce, ...
_CHAIN = "BarrierJobUnsupportedRDDChainException"


def run_fit(spark, prepared_df, num_proc: int, job: BarrierJob, verbose: int = 1
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
    return df.rdd.getNumPartitions()


def _stage(spark, df, num_proc: int, job: BarrierJob, verbose: int):
    """(status, rank 0's result or the problem) of one barrier stage."""
    import cloudpickle

    from horovod_spark._job import driver
    from horovod_spark import progress
    from horovod_spark._job.settings import DriverSettings
    from horovod_spark._job.task import TaskSpec

    sc = spark.sparkContext
    display = progress.Display(verbose)  # the progress bar, from the ranks' records
    shown = display.enabled
    opts = driver.JobOptions(np=num_proc, rank0_only=True, verbose=verbose,
                              settings=DriverSettings.read(),
                              show_output=verbose > 0, stdout=display.stream() if shown else None,
                              stderr=display.stream(None, "stderr") if shown else None)
    limit = driver._checks_before_submit(sc, opts)
    secret, job_id = os.urandom(32), f"hvs-fit-{uuid.uuid4().hex[:12]}/a0"
    server = driver._log_server(sc, secret, job_id, opts)
    store = driver.job_store(sc, secret, opts)
    spec = TaskSpec(job=job_id, secret=secret, payload=b"",
                    log_address=server.address if server else None, show_output=opts.show_output,
                    rank0_only=True, result_limit=limit, env=display.env,
                    warm=opts.settings.warm_start, job_store=store.address if store else None)
    if shown:  # the loops report each step themselves (progress.report)
        job = dataclasses.replace(job, train_fn=progress.Tracked(job.train_fn))
    tag = f"horovod-spark-{job_id.replace('/', '-')}"
    sc.addJobTag(tag)
    ok = False
    try:
        body = functools.partial(task_body, spec, job)
        with transfer_conf(spark):  # planned and submitted with the transfer's confs
            rows = df.mapInArrow(body, RESULT_SCHEMA, barrier=True).collect()
        ok = True
    except Exception as exc:  # Spark's account of a failed rank
        record = driver.failure_of(server, exc, num_proc)
        raise driver.JobFailedError(record) from None
    finally:
        try:
            driver._finish(sc, server, tag, ok, num_proc, store)
        finally:
            display.close()
    for row in sorted(rows, key=lambda r: r.partition):
        if row.status != OK:
            return row.status, row.message
    blob = next(r.payload for r in rows if r.partition == 0)
    value = cloudpickle.loads(blob)[1]
    return value["problem"] if "problem" in value else (OK, value)
