"""The barrier task body of a fit: start the rank, spill, hand back its result.

Each task of the fit's barrier ``mapInArrow`` stage (one per partition, task =
rank = partition id):

1. makes the shard's local directory and starts its rank at once, on a thread,
   through the Spark runner's task machinery (``horovod_spark._job.task.run_task``:
   the rank process, its rendezvous relayed over ``allGather``, its output
   streamed to the driver); the rank's payload is the training function, the
   TrainSpec and that directory, so the rank imports its framework and joins
   the others while the task reads its data;
2. spills its partition to local Arrow files (``_spill.spill_partition``) and
   writes the partition's census next to them (``_census``), even when the
   spill found bad data, so the rank never waits in vain;
3. waits for the rank and yields one row ``(partition, status, message,
   payload)``: ``ok`` with the rank's pickled result record (rank 0's value is
   the trained model, or the problem the ranks agreed on).

The spill directory is removed in ``finally``.
"""
from __future__ import annotations

import dataclasses
import shutil
import tempfile
import threading
import time
from typing import Iterator

from horovod_spark.estimator._census import OK, write_census
from horovod_spark.estimator._job import FitJob
from horovod_spark.estimator._spill import local_dir, spill_partition

__all__ = ["RESULT_SCHEMA", "task_body"]

RESULT_SCHEMA = "partition int, status string, message string, payload binary"


def _row(partition: int, status: str, message: str = "", payload: bytes = b""):
    import pyarrow as pa

    return pa.RecordBatch.from_arrays(
        [pa.array([partition], pa.int32()), pa.array([status]), pa.array([message]),
         pa.array([payload], pa.binary())],
        names=["partition", "status", "message", "payload"])


class _Rank(threading.Thread):
    """The rank, run by the runner's task code while this task spills."""

    def __init__(self, task_spec, job: FitJob, directory: str):
        from horovod_spark._job import pickle_job

        super().__init__(name="hvs-estimator-rank", daemon=True)
        self.spec = dataclasses.replace(
            task_spec, payload=pickle_job(job.train_fn, (job.train, directory)))
        self.result = None
        self.error = None

    def run(self) -> None:
        from horovod_spark._job import run_task

        try:
            self.result = next(run_task(self.spec, iter(())))
        except BaseException as exc:  # re-raised on the task's own thread
            self.error = exc


def _watched(batches: Iterator, rank: _Rank) -> Iterator:
    """The partition's batches; stops the spill as soon as the rank has failed."""
    for batch in batches:
        if rank.error is not None:
            raise rank.error
        yield batch


def _spill(batches, job: FitJob, partition: int, directory: str) -> dict:
    began, task_start, cpu = time.perf_counter(), time.time(), time.thread_time()
    census = spill_partition(batches, job.specs, partition, job.validation_fraction,
                             job.train.seed, directory=directory).to_dict()
    # cpu_seconds: this thread's share (Arrow from the JVM, checks, writes); the JVM's
    # own work (reading, vectors to arrays, Arrow out) is not in it
    census.update(seconds=time.perf_counter() - began, cpu_seconds=time.thread_time() - cpu,
                  stamps={"task_start": task_start, "spilled": time.time()})
    return census


def task_body(task_spec, job: FitJob, batches: Iterator) -> Iterator:
    """The mapInArrow function of the fit's barrier stage."""
    from pyspark import BarrierTaskContext

    partition = BarrierTaskContext.get().partitionId()
    directory = tempfile.mkdtemp(prefix=f"hvs-est-p{partition}-", dir=local_dir())
    rank = _Rank(task_spec, job, directory)
    try:
        rank.start()
        census = {"partition": partition, "train_rows": 0, "val_rows": 0, "widths": {},
                  "problem": "the task's spill failed"}
        try:
            if job.parquet is not None:  # this task reads its row groups (see _parquet)
                from horovod_spark.estimator._parquet import read_share

                for _ in batches:  # its partition of the range: nothing to hand on
                    pass
                batches = read_share(job.parquet[0], job.parquet[1][partition], job.specs)
            census = _spill(_watched(batches, rank), job, partition, directory)
        finally:
            write_census(directory, census)
        rank.join()
        if rank.error is not None:
            raise rank.error
        rank_id, blob = rank.result[:2]
        yield _row(rank_id, OK, "", blob or b"")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
