"""What the driver hands to the barrier tasks and what the tasks hand to the ranks.

``FitJob`` travels (pickled) into every task of the fit's barrier stage;
``TrainSpec`` is the part the rank process needs, completed on the rank with the
row counts of every shard once the ranks have exchanged their censuses
(``_census.agree``).  Both are frozen: copies are made with ``dataclasses.replace``.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from horovod_spark.settings import PROGRESS
from horovod_spark.estimator.data import ColumnSpec, keeps_lists
from horovod_spark.estimator.store import Store

__all__ = ["TrainSpec", "FitJob", "RankData", "Progress", "append_history", "averaged",
           "fit_on_rank"]


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    user: bytes                              # cloudpickle of the framework's user objects
    feature_cols: Tuple[str, ...]
    label_cols: Tuple[str, ...]
    weight_col: Optional[str]
    batch_size: int
    epochs: int
    shuffle: bool
    seed: int
    backward_passes_per_step: int
    use_gpu: bool
    verbose: int
    store: Store
    run_id: str
    has_validation: bool
    specs: Tuple[ColumnSpec, ...] = ()       # the used columns, for census messages
    num_proc: int = 0
    train_rows: Tuple[int, ...] = ()         # per rank, from the census
    val_rows: Tuple[int, ...] = ()
    data_seconds: float = 0.0                # this task's spill time
    data_cpu_seconds: float = 0.0            # the CPU time of its Python side
    stamps: Tuple[Tuple[str, float], ...] = ()  # wall-clock times of the task's phases
    val_batch_size: int = 0                  # 0: batch_size
    train_steps: Optional[int] = None        # train_steps_per_epoch
    val_steps: Optional[int] = None          # validation_steps_per_epoch
    tensorboard: Optional[bool] = None       # None: when tensorboardX is installed
    log_every_n_steps: int = 50
    early_stopping: Any = None               # trainer.EarlyStopping
    keep_best: Optional[Tuple[str, str]] = None  # (metric, mode) that picks the fitted epoch
    store_probe: str = ""                    # a file the driver wrote in the store (_census)
    resume: bool = False                     # run_id was given: a later fit resumes it


@dataclasses.dataclass(frozen=True)
class FitJob:
    specs: Tuple[ColumnSpec, ...]
    validation_fraction: float
    train: TrainSpec
    train_fn: Callable[..., Any]             # (TrainSpec, shard directory) -> result, on the rank
    parquet: Optional[Any] = None            # _parquet.Plan: tasks read their row groups


class RankData:
    """A rank's view of its shard: the training stream and the validation rows."""

    def __init__(self, spec: TrainSpec, directory: str, rank: int):
        from horovod_spark.estimator._reader import BatchStream, Shard, steps_per_epoch

        names = list(dict.fromkeys(spec.feature_cols + spec.label_cols +
                                   ((spec.weight_col,) if spec.weight_col else ())))
        self.names = names
        pads = {s.name: s.pad for s in spec.specs if keeps_lists(s)}
        self.train = Shard(os.path.join(directory, "train.arrow"), names, pads)
        self.stream = BatchStream(self.train, spec.batch_size, spec.shuffle, spec.seed, rank)
        multiple = spec.backward_passes_per_step
        self.steps = steps_per_epoch(spec.train_rows, spec.batch_size, multiple) \
            if spec.train_steps is None else -(-spec.train_steps // multiple) * multiple
        self.val_batch_size = spec.val_batch_size or spec.batch_size
        self.val_steps = spec.val_steps
        self.val = Shard(os.path.join(directory, "val.arrow"), names, pads) \
            if spec.has_validation else None
        self.rank, self.seed = rank, spec.seed
        self.decode, self.decode_workers = None, 0

    def decoding(self, fn, workers: Optional[int], local_size: int) -> None:
        """Batches go through decode_fn `fn` in `workers` threads (None: the default for
        this rank's share of the host's cores); see ``_decode``."""
        from horovod_spark.estimator._decode import default_workers

        self.decode = fn
        self.decode_workers = 0 if fn is None else \
            (default_workers(local_size) if workers is None else workers)

    def epoch(self, epoch: int):
        from horovod_spark.estimator._decode import decoded

        return decoded(self.stream.epoch(epoch, self.steps), self.decode, self.decode_workers,
                       f"epoch {epoch} of partition {self.rank} (rank {self.rank})",
                       (self.seed, self.rank, 0, epoch))

    def validation(self):
        """This rank's validation batches (at most val_steps of them)."""
        import itertools

        from horovod_spark.estimator._decode import decoded
        from horovod_spark.estimator._reader import sequential_batches

        if self.val is None:
            return iter(())
        rows = itertools.islice(sequential_batches(self.val, self.val_batch_size), self.val_steps)
        return decoded(rows, self.decode, self.decode_workers,
                       f"the validation rows of partition {self.rank} (rank {self.rank})",
                       (self.seed, self.rank, 1))

    def close(self) -> None:
        self.train.close()
        if self.val is not None:
            self.val.close()


class Progress:
    """Rank 0's one line per epoch, the progress display's records, and the timings
    a benchmark reads: durations, and wall-clock stamps of the phases (task start,
    spilled, rank entry, initialized, agreed, ready, trained) that show where a
    fit's time goes."""

    REPORT_EVERY = 0.1  # seconds between two progress records from the training loop

    def __init__(self, spec: TrainSpec, rank: int, steps: int, entered: float):
        from horovod_spark import progress

        self.report = progress.report  # the driver's progress bar, when it shows one
        self.reporting = PROGRESS.read()  # the rank's edge: its training loop starts
        self.unreported, self.next_report = 0, 0.0
        self.verbose = spec.verbose if rank == 0 else 0
        self.epochs, self.steps, self.run_id = spec.epochs, steps, spec.run_id
        self.batch_size = spec.batch_size
        self.train_seconds = 0.0
        # process_time counts from the process start: python, imports, hvd.init, the setup
        self.started, self.cpu_started = time.perf_counter(), time.process_time()
        self.data_cpu_seconds = spec.data_cpu_seconds
        self.stamps = dict(spec.stamps, rank_entry=entered, ready=time.time())
        if spec.verbose >= 2:
            print(f"rank {rank}: {spec.train_rows[rank]} training rows, "
                  f"{spec.val_rows[rank] if spec.val_rows else 0} validation rows, "
                  f"{steps} steps per epoch", flush=True)

    def step_done(self, epoch: int, step: int, loss: Any) -> None:
        """One batch trained; the display hears of it at most every REPORT_EVERY
        seconds (and always of an epoch's last batch), with the batches since the
        last report as samples, so the loop does not pay for a report, nor for
        reading ``loss`` (a tensor, perhaps on a GPU), per batch."""
        if not self.reporting:
            return
        self.unreported += 1
        now = time.monotonic()
        if now < self.next_report and step + 1 < self.steps:
            return
        self.next_report = now + self.REPORT_EVERY
        self.report(epoch=epoch, step=step, steps=self.steps, epochs=self.epochs,
                    samples=self.batch_size * self.unreported, loss=float(loss))
        self.unreported = 0

    def epoch_done(self, epoch: int, metrics: Dict[str, float], seconds: float) -> None:
        self.train_seconds += seconds
        if self.verbose:
            text = ", ".join(f"{k} {v:.4g}" for k, v in metrics.items())
            print(f"epoch {epoch + 1}/{self.epochs} ({self.steps} steps, {seconds:.2f} s): "
                  f"{text}", flush=True)

    def timings(self, data_seconds: float) -> Dict[str, Any]:
        return {"data_seconds": data_seconds, "train_seconds": self.train_seconds,
                "data_cpu_seconds": self.data_cpu_seconds,
                "rank_seconds": time.perf_counter() - self.started,
                "rank_cpu_seconds": time.process_time() - self.cpu_started,
                "rank_start_cpu_seconds": self.cpu_started,
                "stamps": dict(self.stamps, trained=time.time())}


def fit_on_rank(hvd, spec: TrainSpec, directory: str,
                fit: Callable[[TrainSpec, "RankData", float], Any],
                after_census: Optional[Callable[[], None]] = None) -> Any:
    """The start every framework's rank side shares: ``hvd.init()`` (while the task still
    spills the rank's partition), the census of every shard (``_census.agree``: row
    counts, or the problem rank 0 returns instead of training), then
    ``fit(spec, data, entered)`` on this rank's mapped shard, closed after.
    ``after_census()`` runs once the census is in, whatever it found."""
    from horovod_spark.estimator._census import agree

    entered = time.time()
    hvd.init()
    spec = dataclasses.replace(spec, stamps=spec.stamps + (("initialized", time.time()),))
    problem, spec = agree(hvd.allgather_object, spec, directory)
    if after_census is not None:
        after_census()
    if problem is not None:
        return {"problem": problem} if hvd.rank() == 0 else None
    data = RankData(spec, directory, hvd.rank())
    try:
        return fit(spec, data, entered)
    finally:
        data.close()


def append_history(history: Dict[str, List[float]], metrics: Dict[str, float]) -> None:
    for name, value in metrics.items():
        history.setdefault(name, []).append(float(value))


def averaged(names: Sequence[str], sums: Sequence[float], counts: Sequence[float]
             ) -> Dict[str, float]:
    """Plain floats (a callback prints 0.25, not np.float64(0.25))."""
    return {n: (float(s) / float(c) if c else float("nan"))
            for n, s, c in zip(names, sums, counts)}
