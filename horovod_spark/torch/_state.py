"""Process-global state of `horovod_spark.torch`: Horovod's basics over one HorovodState.

See `horovod_spark.common.basics` for what init() and shutdown() do; every op of
this package goes through the state's fusion engine.  Per-step metrics are kept
here too: `DistributedOptimizer.step` records its step time and the time it
waited for gradients.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import time
from typing import Optional

from ..common.basics import HorovodState
from ._errors import InvalidArgument

__all__ = ["init", "shutdown", "is_initialized", "engine", "submit", "refused_as_invalid_argument",
           "waiting_now", "view",
           "set_size", "set_rank", "global_process_set", "add_process_set", "remove_process_set",
           "communicator", "rank", "size",
           "local_rank", "local_size", "cross_rank", "cross_size", "is_homogeneous",
           "metrics", "record_step", "op_name", "start_timeline", "stop_timeline"]

TRANSPORT_KEYS = ("shm_ops", "shm_bytes", "pipelined_ops", "tcp_ops", "tcp_bytes_sent",
                  "tcp_bytes_received")
_counters: dict = {}
_steps = {"steps": 0, "step_time_s": 0.0, "last_step_time_s": 0.0, "sync_wait_s": 0.0}


def _on_init() -> None:
    _counters.clear()
    _reset_steps()
    _pin_gpu()


def _pin_gpu() -> None:
    """On a Spark task's GPU, make it torch's current device (what Horovod scripts do with
    torch.cuda.set_device(hvd.local_rank()): that line still works, and is now optional)."""
    from ..common.basics import gpu_ordinal

    ordinal = gpu_ordinal()
    if ordinal is None:
        return
    import torch

    if torch.cuda.is_available() and ordinal < torch.cuda.device_count():
        torch.cuda.set_device(ordinal)


STATE = HorovodState("horovod_spark.torch", __name__, on_init=_on_init, lane=True)

STATE.bind(globals())  # init, shutdown, rank, size, ... (common.basics.BASICS)


def view(process_set, what: str):
    """The process set an op runs on (None: the global set); a refusal is an InvalidArgument."""
    try:
        return STATE.process_set(process_set, what)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from exc


def set_size(ps) -> int:
    """The size of the set an op runs on (the world's for None)."""
    return size() if ps is None else ps.size


def set_rank(ps) -> int:
    return rank() if ps is None else ps.rank


_local = threading.local()


@contextlib.contextmanager
def waiting_now():
    """The ops this thread submits inside are waited for as soon as it exits (a blocking
    op, or the one gradient group of a step): they go to the engine `lazy`, so the wait
    runs their cycle on this thread and the engine's thread is not woken for them."""
    before = getattr(_local, "now", False)
    _local.now = True
    try:
        yield
    finally:
        _local.now = before


def submit(name: str, kind: str, *args, view=None, **kwargs):
    """engine().submit (the set's, for a process set's `view`), lazy inside waiting_now(); a
    refused argument is an InvalidArgument (a ValueError, and the RuntimeError a Horovod
    script catches)."""
    eng = engine() if view is None else view
    try:  # (not refused_as_invalid_argument: a generator's context costs more than this op)
        return eng.submit(name, kind, *args, lazy=getattr(_local, "now", False), **kwargs)
    except InvalidArgument:
        raise
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from exc


@contextlib.contextmanager
def refused_as_invalid_argument():
    """An argument the engine refuses (a ValueError) becomes an InvalidArgument."""
    try:
        yield
    except ValueError as exc:
        if isinstance(exc, InvalidArgument):
            raise
        raise InvalidArgument(str(exc)) from exc


def op_name(kind: str, name: Optional[str], ps=None) -> str:
    """Horovod's naming: 'allreduce.<name>', or 'allreduce.noname.<n>' in call order, counted
    per process set (a rank outside a set must not count its ops)."""
    if name is not None:
        return f"{kind}.{name}"
    counter = _counters.setdefault(kind if ps is None else (kind, ps.tag), itertools.count())
    return f"{kind}.noname.{next(counter)}"


def _reset_steps() -> None:
    _steps.update(steps=0, step_time_s=0.0, last_step_time_s=0.0, sync_wait_s=0.0)
    _steps["_last"] = None


def record_step(sync_wait_s: float) -> None:
    """Called by DistributedOptimizer.step(): one step ended now."""
    now = time.perf_counter()
    last = _steps.get("_last")
    _steps["_last"] = now
    _steps["sync_wait_s"] += sync_wait_s
    if last is not None:
        _steps["steps"] += 1
        _steps["last_step_time_s"] = now - last
        _steps["step_time_s"] += now - last


def metrics(reset: bool = False) -> dict:
    """What the last steps cost, since init() or the last reset.

    Keys: steps; step_time_s (mean time between optimizer steps);
    last_step_time_s; sync_wait_s (mean time a step waited for its gradients);
    allreduce_time_s (mean time per step inside allreduce collectives);
    bytes_reduced and bytes_reduced_per_step; tensors_reduced; per transport,
    what this rank moved (shm_ops, shm_bytes: ops through its host's shared
    memory and their payload; pipelined_ops: allreduces across hosts whose
    shared-memory phases overlapped the leaders' ring; tcp_ops, tcp_bytes_sent,
    tcp_bytes_received), the
    engine's coordination included; and the engine's counters (cycles,
    negotiations, fused_buffers, coordination_s...).
    """
    eng = engine().metrics(reset=reset)
    n = max(_steps["steps"], 1)
    out = {
        "steps": _steps["steps"],
        "step_time_s": _steps["step_time_s"] / n,
        "last_step_time_s": _steps["last_step_time_s"],
        "sync_wait_s": _steps["sync_wait_s"] / n,
        "allreduce_time_s": eng["collective_s"] / n,
        "bytes_reduced": int(eng["allreduce_bytes"]),
        "bytes_reduced_per_step": eng["allreduce_bytes"] / n,
        "tensors_reduced": int(eng["allreduce_tensors"]),
    }
    out.update({k: int(eng[k]) for k in TRANSPORT_KEYS if k in eng})
    out.update({f"engine_{k}": v for k, v in eng.items()})
    if reset:
        last = _steps["_last"]
        _reset_steps()
        _steps["_last"] = last
    return out
