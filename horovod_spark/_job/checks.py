"""Checks the driver runs before it submits a barrier stage.

Spark itself would wait: a barrier stage with more tasks than free slots is
retried for ten minutes (40 checks, 15 s apart) before it fails with a
generic message.  These checks fail in seconds, and every message says what
to change.  A *slot* is room for one task: cores / spark.task.cpus on an
executor, and GPUs / spark.task.resource.gpu.amount where tasks ask for GPUs.
"""
from __future__ import annotations

import math
import re
import sys
import time
from typing import Optional

__all__ = ["check_np", "check_dynamic_allocation", "check_gpus", "wait_for_slots",
           "expected_slots", "local_slots", "parse_bytes", "max_result_size", "check_result_size"]

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "p": 1 << 50, "pb": 1 << 50}


def check_np(np_) -> int:
    """np must be a non-zero int: > 0 on Spark, < 0 locally on the driver."""
    if isinstance(np_, bool) or not isinstance(np_, int):
        raise TypeError(f"np must be an int (ranks on Spark, or negative for local ranks), "
                        f"got {type(np_).__name__} {np_!r}")
    if np_ == 0:
        raise ValueError("np=0 runs no rank; use np > 0 for Spark tasks, or np < 0 to run "
                         "-np ranks locally on the driver")
    return np_


def parse_bytes(text: str) -> int:
    """Spark's size syntax ("1g", "512m", "1024"): a count of bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size in Spark's syntax (e.g. 1g, 512m): {text!r}")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def max_result_size(conf) -> int:
    """spark.driver.maxResultSize in bytes; 0 means no limit."""
    return parse_bytes(conf.get("spark.driver.maxResultSize", "1g"))


def check_result_size(nbytes: int, limit: int, rank: int) -> None:
    """Refuse a result Spark would refuse, with a message that names the fix."""
    if limit and nbytes > limit:
        raise ValueError(
            f"the return value of rank {rank} is {_human(nbytes)} pickled, over "
            f"spark.driver.maxResultSize={_human(limit)}; return something smaller (save the "
            f"model to shared storage and return its path), or raise spark.driver.maxResultSize")


def _human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _is_local(master: str) -> bool:
    return master == "local" or master.startswith("local[")


def check_dynamic_allocation(conf, master: str) -> None:
    enabled = str(conf.get("spark.dynamicAllocation.enabled", "false")).lower() == "true"
    if enabled and not _is_local(master):
        raise ValueError(
            "spark.dynamicAllocation.enabled=true: barrier stages cannot run with dynamic "
            "allocation (Spark would fail the job after submitting it); set "
            "spark.dynamicAllocation.enabled=false and a fixed spark.executor.instances")


def _float(conf, key: str) -> float:
    try:
        return float(conf.get(key, "0") or 0)
    except ValueError:
        raise ValueError(f"{key}={conf.get(key)!r} is not a number") from None


def check_gpus(conf, np_: int, warn=None) -> None:
    """GPU amounts must give each rank whole GPUs of its own."""
    task_gpu = _float(conf, "spark.task.resource.gpu.amount")
    executor_gpu = _float(conf, "spark.executor.resource.gpu.amount")
    if 0 < task_gpu < 1:
        share = int(round(1 / task_gpu))
        raise ValueError(
            f"spark.task.resource.gpu.amount={task_gpu:g} lets {share} ranks share one GPU, and "
            f"a collective needs one GPU per rank; set spark.task.resource.gpu.amount=1")
    if executor_gpu and task_gpu > executor_gpu:
        raise ValueError(
            f"spark.task.resource.gpu.amount={task_gpu:g} is more than the "
            f"spark.executor.resource.gpu.amount={executor_gpu:g} GPUs of an executor, so no "
            f"task of the {np_} ranks can ever start; lower the task amount")
    driver_gpu = _float(conf, "spark.driver.resource.gpu.amount")
    if task_gpu and _is_local(str(conf.get("spark.master", ""))) and driver_gpu < task_gpu:
        raise ValueError(
            f"spark.task.resource.gpu.amount={task_gpu:g} on a local master: local tasks take "
            f"GPUs from the driver, which has spark.driver.resource.gpu.amount={driver_gpu:g}, so "
            f"no task would ever be scheduled; set spark.driver.resource.gpu.amount and "
            f"spark.driver.resource.gpu.discoveryScript, or unset spark.task.resource.gpu.amount")
    if executor_gpu and not task_gpu:
        (warn or _warn)(
            f"executors have spark.executor.resource.gpu.amount={executor_gpu:g} GPUs, but tasks "
            f"ask for none, so every rank sees every GPU; set spark.task.resource.gpu.amount=1 "
            f"to give each of the {np_} ranks its own GPU")


def _warn(msg: str) -> None:
    print(f"horovod_spark: warning: {msg}", file=sys.stderr)


def _per_executor(conf, cores: int) -> int:
    per = cores // max(int(_float(conf, "spark.task.cpus") or 1), 1)
    task_gpu = _float(conf, "spark.task.resource.gpu.amount")
    executor_gpu = _float(conf, "spark.executor.resource.gpu.amount")
    if task_gpu and executor_gpu:
        per = min(per, math.floor(executor_gpu / task_gpu))
    return per


def expected_slots(conf, master: str) -> Optional[int]:
    """Slots the configuration promises once every executor is up, or None if unknown."""
    m = re.fullmatch(r"local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*\d+\s*\]", master)
    if m:
        return int(m.group(1)) * _per_executor(conf, int(m.group(2)))
    instances, cores = conf.get("spark.executor.instances"), conf.get("spark.executor.cores")
    if instances and cores and not _is_local(master):
        return int(instances) * _per_executor(conf, int(cores))
    return None


def local_slots(conf, master: str) -> Optional[int]:
    """Slots of a local[N] master (N / spark.task.cpus); None for local[*] or another master."""
    m = re.fullmatch(r"local(?:\[\s*(\d+)\s*(?:,\s*\d+\s*)?\])?", master)
    if not m:
        return None
    return int(m.group(1) or 1) // max(int(_float(conf, "spark.task.cpus") or 1), 1)


def _slots_message(cluster, np_: int, slots: Optional[int], promised: Optional[int],
                   waited: float) -> str:
    conf = cluster.conf
    msg = f"np={np_} ranks need {np_} barrier task slots, but the cluster has {slots}"
    if promised is not None and promised != slots:
        msg += f" ({promised} once every configured executor is up)"
    if waited:
        msg += f" after waiting {waited:g} s for executors"
    executors = cluster.executors()
    msg += (f" [{executors} executor(s) of" if executors is not None else " [") + \
        f" master {cluster.master}, spark.task.cpus={conf.get('spark.task.cpus', '1')}"
    task_gpu = _float(conf, "spark.task.resource.gpu.amount")
    if task_gpu:
        msg += f", {_float(conf, 'spark.executor.resource.gpu.amount'):g} GPU(s) per executor, " \
               f"{task_gpu:g} per task"
    best = max(slots or 0, promised or 0)
    msg += "]; " + (f"run with np={best}, or " if best else "") + \
        "add executors, cores or GPUs, or pass np < 0 to run the ranks locally on the driver"
    return msg


def wait_for_slots(cluster, np_: int, timeout: float, poll: float = 0.2, say=None) -> Optional[int]:
    """Wait (up to `timeout`) for np_ slots; raise ValueError when they cannot come.

    `cluster` is the session's `cluster.Cluster`.  `say(message)` hears, every 10 s of
    waiting, how many slots there are so far, and, once, where they cannot be counted
    (a Spark Connect client whose configuration promises no number).
    """
    promised = expected_slots(cluster.conf, cluster.master)
    if cluster.connect:  # no scheduler to ask: what the configuration promises
        slots = cluster.available_slots()
        if slots is None:
            if say is not None:
                cluster.tell_once(
                    f"cannot count the barrier task slots from a Spark Connect client (master "
                    f"{cluster.master or 'unknown'}); with fewer than np={np_} free, Spark fails "
                    f"the stage after its own retries", say)
            return None
        if slots < np_:
            raise ValueError(_slots_message(cluster, np_, slots, None, 0))
        return slots
    start = next_note = time.monotonic()
    while True:
        slots = cluster.available_slots()
        if slots >= np_:
            return slots
        waited = time.monotonic() - start
        if _is_local(cluster.master) or (promised is not None and promised < np_) or \
                waited >= timeout:
            raise ValueError(_slots_message(cluster, np_, slots, promised, round(waited, 1)))
        if say is not None and time.monotonic() >= next_note + 10:
            next_note = time.monotonic()
            say(f"waiting for executors: {slots} of the {np_} task slots after {waited:.0f} s "
                f"(start_timeout={timeout:g} s)")
        time.sleep(poll)
