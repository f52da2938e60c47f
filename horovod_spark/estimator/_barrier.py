"""The barrier task body of a fit: spill, agree, run the rank, hand back its result.

Each task of the fit's barrier ``mapInArrow`` stage (one per partition, task =
rank = partition id):

1. spills its partition to local Arrow files (``_spill.spill_partition``);
2. exchanges censuses with every task (one ``BarrierTaskContext.allGather``
   round): each task then knows every shard's row count, and whether any task
   found bad data or an empty shard;
3. if none did, runs its rank through the Spark runner's task machinery
   (``horovod_spark._task.run_task``: the rank process, its rendezvous relayed
   over ``allGather``, its output streamed to the driver), with the rank's own
   payload: the training function, the TrainSpec completed with the row counts,
   and the directory of this task's shard;
4. yields one row ``(partition, status, message, payload)``: status ``ok`` with
   the rank's pickled result record, or ``problem`` / ``empty`` with the reason,
   on every task alike, so the driver raises one clear error.

The spill directory is removed in ``finally``.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import time
from typing import Iterator, List, Optional

from horovod_spark.estimator._job import BarrierJob
from horovod_spark.estimator._spill import feature_widths, first_problem, spill_partition

__all__ = ["RESULT_SCHEMA", "task_body", "census_problem"]

RESULT_SCHEMA = "partition int, status string, message string, payload binary"
OK, PROBLEM, EMPTY = "ok", "problem", "empty"


def _row(partition: int, status: str, message: str = "", payload: bytes = b""):
    import pyarrow as pa

    return pa.RecordBatch.from_arrays(
        [pa.array([partition], pa.int32()), pa.array([status]), pa.array([message]),
         pa.array([payload], pa.binary())],
        names=["partition", "status", "message", "payload"])


def census_problem(censuses: List[dict], job: BarrierJob) -> Optional[tuple]:
    """(status, message) when the fit can't start, else None; the same on every task."""
    problem = first_problem(censuses)
    if problem:
        return PROBLEM, problem
    try:
        feature_widths(censuses, job.specs)
    except ValueError as exc:
        return PROBLEM, str(exc)
    if job.train.has_validation and not sum(c["val_rows"] for c in censuses):
        return PROBLEM, "validation left no validation rows; use a larger fraction, or mark " \
                        "some rows in the validation column"
    empty = [c["partition"] for c in censuses if c["train_rows"] == 0]
    if empty:
        rows = [c["train_rows"] for c in sorted(censuses, key=lambda c: c["partition"])]
        return EMPTY, (f"partition(s) {empty} of {len(censuses)} have no training rows "
                       f"(rows per partition: {rows})")
    return None


def task_body(task_spec, job: BarrierJob, batches: Iterator) -> Iterator:
    """The mapInArrow function of the fit's barrier stage."""
    from pyspark import BarrierTaskContext

    from horovod_spark._driver import pickle_job
    from horovod_spark._task import run_task

    ctx = BarrierTaskContext.get()
    partition = ctx.partitionId()
    began, task_start = time.perf_counter(), time.time()
    census = spill_partition(batches, job.specs, partition, job.validation_fraction,
                             job.train.seed)
    spilled = time.time()
    try:
        censuses = [json.loads(m) for m in ctx.allGather(json.dumps(census.to_dict()))]
        problem = census_problem(censuses, job)
        if problem is not None:
            yield _row(partition, *problem)
            return
        by_part = sorted(censuses, key=lambda c: c["partition"])
        spec = dataclasses.replace(
            job.train, train_rows=tuple(c["train_rows"] for c in by_part),
            val_rows=tuple(c["val_rows"] for c in by_part),
            data_seconds=time.perf_counter() - began,
            stamps=(("task_start", task_start), ("spilled", spilled), ("agreed", time.time())))
        rank_spec = dataclasses.replace(
            task_spec, payload=pickle_job(job.train_fn, (spec, census.directory)))
        rank, blob = next(run_task(rank_spec, iter(())))
        yield _row(rank, OK, "", blob or b"")
    finally:
        shutil.rmtree(census.directory, ignore_errors=True)
