"""The census: what the ranks agree on about their shards before any step.

Each barrier task spills its partition while its rank process starts (they run
at the same time); the task then writes the partition's census (row counts,
column widths, the first bad row it met, its spill time) to ``census.json`` in
the shard's directory.  The rank waits for that file, and the ranks exchange
censuses with one ``allgather_object``: every rank then knows every shard's row
count (for the steps per epoch) and whether any task found bad data, an empty
shard, or a stage of the wrong size; in that case every rank returns the same
problem instead of training, and the driver raises it (or repartitions).  The
census also says whether the rank sees the file the driver wrote in the Store:
a Store the ranks do not share cannot resume a run (store_problem).
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import time
from typing import List, Optional, Sequence, Tuple

from horovod_spark.estimator._spill import feature_widths, first_problem
from horovod_spark.estimator.data import ColumnSpec

__all__ = ["OK", "PROBLEM", "EMPTY", "write_census", "agree", "census_problem"]

OK, PROBLEM, EMPTY = "ok", "problem", "empty"
CENSUS = "census.json"
POLL = 0.02  # seconds between looks for the task's census file


def write_census(directory: str, census: dict) -> None:
    """Atomically, so the rank never reads half a file."""
    tmp = os.path.join(directory, CENSUS + ".tmp")
    with open(tmp, "w") as f:
        json.dump(census, f)
    os.replace(tmp, os.path.join(directory, CENSUS))


def _wait_census(directory: str) -> dict:
    """This rank's census; the task always writes one (a task that dies takes its
    rank process with it), however long its spill takes."""
    path = os.path.join(directory, CENSUS)
    while not os.path.exists(path):
        time.sleep(POLL)
    with open(path) as f:
        return json.load(f)


def _sees(spec) -> bool:
    try:
        return not spec.store_probe or spec.store.exists(spec.store_probe)
    except NotImplementedError:  # a Store of the user's that cannot tell: not our business
        return True
    except Exception:  # a store this rank cannot even reach is not shared either
        return False


def store_problem(censuses: List[dict], spec, warn: bool) -> Optional[Tuple[str, str]]:
    """A Store some ranks do not share: an error where the fit names a run_id to resume
    (its checkpoints would stay on rank 0's host), else a warning printed by rank 0."""
    blind = [(c["partition"], c.get("host")) for c in censuses if not c.get("store_seen", True)]
    if not blind:
        return None
    message = (f"the Store {spec.store!r} is not shared: ranks {[r for r, _ in blind]} (on hosts "
               f"{sorted({h for _, h in blind})}) cannot see {spec.store_probe}, which the driver "
               f"wrote; checkpoints would stay on rank 0's host, so fitting run_id "
               f"{spec.run_id!r} again would start at epoch 0 wherever rank 0 lands, and "
               f"the model would not be where a reader looks.  Use a store that the driver and "
               f"every executor reach at the same path: HDFS, S3 or DBFS "
               f"(Store.create('hdfs://...')), or a shared mount such as NFS")
    if spec.resume:
        return PROBLEM, message
    if warn:
        print(f"horovod_spark: warning: {message}", file=sys.stderr, flush=True)
    return None


def census_problem(censuses: List[dict], specs: Sequence[ColumnSpec], has_validation: bool,
                   num_proc: int) -> Optional[Tuple[str, str]]:
    """(status, message) when the fit can't start, else None; the same on every rank."""
    if len(censuses) != num_proc:  # adaptive execution merged partitions
        return EMPTY, f"the stage has {len(censuses)} partitions, not num_proc={num_proc}"
    problem = first_problem(censuses)
    if problem:
        return PROBLEM, problem
    try:
        feature_widths(censuses, specs)
    except ValueError as exc:
        return PROBLEM, str(exc)
    if has_validation and not sum(c["val_rows"] for c in censuses):
        return PROBLEM, "validation left no validation rows; use a larger fraction, or mark " \
                        "some rows in the validation column"
    empty = [c["partition"] for c in censuses if c["train_rows"] == 0]
    if empty:
        rows = [c["train_rows"] for c in censuses]
        return EMPTY, (f"partition(s) {empty} of {len(censuses)} have no training rows "
                       f"(rows per partition: {rows})")
    return None


def agree(allgather_object, spec, directory: str):
    """(problem or None, the TrainSpec completed with every shard's row counts)."""
    own = _wait_census(directory)
    own = dict(own, store_seen=_sees(spec), host=socket.gethostname())
    waited = time.time()
    censuses = sorted(allgather_object(own), key=lambda c: c["partition"])
    problem = census_problem(censuses, spec.specs, spec.has_validation, spec.num_proc) \
        or store_problem(censuses, spec, own["partition"] == 0)
    stamps = tuple(own.get("stamps", {}).items()) + (("census_read", waited),
                                                      ("agreed", time.time()))
    return problem, dataclasses.replace(
        spec, train_rows=tuple(c["train_rows"] for c in censuses),
        val_rows=tuple(c["val_rows"] for c in censuses), data_seconds=own.get("seconds", 0.0),
        data_cpu_seconds=own.get("cpu_seconds", 0.0),
        stamps=spec.stamps + stamps)
