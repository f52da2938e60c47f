"""Process-global state of `horovod_spark.torch`: one communicator and one engine.

`init()` builds the communicator from the rank environment (the local
launcher, the Spark task, mpiexec; a world of one otherwise) and starts the
fusion engine over it; every op of this package goes through that engine, so
ops from any thread are negotiated, fused and timed.  `shutdown()` stops the
engine on every rank and closes the communicator.  Per-step metrics are kept
here too: `DistributedOptimizer.step` records its step time and the time it
waited for gradients.
"""
from __future__ import annotations

import atexit
import itertools
import threading
import time
from typing import Optional

import collectives
from collectives.fusion import FusionEngine

__all__ = ["init", "shutdown", "is_initialized", "engine", "communicator", "rank", "size",
           "local_rank", "local_size", "cross_rank", "cross_size", "is_homogeneous",
           "metrics", "record_step", "op_name", "start_timeline", "stop_timeline"]

_lock = threading.Lock()
_comm: Optional[collectives.Communicator] = None
_engine: Optional[FusionEngine] = None
_counters: dict = {}
_steps = {"steps": 0, "step_time_s": 0.0, "last_step_time_s": 0.0, "sync_wait_s": 0.0}
_NOT_INIT = "horovod_spark.torch has not been initialized; call hvd.init() first"


def init(comm: Optional[collectives.Communicator] = None,
         config: Optional[collectives.Config] = None) -> None:
    """Join the job (a no-op while initialized).

    Args:
        comm: an existing collectives.Communicator to use instead of building one.
        config: a collectives.Config; by default built from HOROVOD_* variables.
    """
    global _comm, _engine
    with _lock:
        if _comm is not None:
            return
        if comm is not None and not isinstance(comm, collectives.Communicator):
            raise TypeError(f"init(comm=...) takes a collectives.Communicator, got "
                            f"{type(comm).__name__}; MPI sub-communicators are not supported")
        comm = comm if comm is not None else collectives.init(config)
        _engine = FusionEngine(comm, config if config is not None else comm.config)
        _comm = comm
        _counters.clear()
        _reset_steps()


def shutdown() -> None:
    """Leave the job: stop the engine on every rank and close the communicator."""
    global _comm, _engine
    with _lock:
        comm, eng, _comm, _engine = _comm, _engine, None, None
    try:
        if eng is not None:
            eng.shutdown()
    finally:
        if comm is not None:
            comm.close()


atexit.register(shutdown)


def is_initialized() -> bool:
    return _comm is not None


def communicator() -> collectives.Communicator:
    if _comm is None:
        raise ValueError(_NOT_INIT)
    return _comm


def engine() -> FusionEngine:
    eng = _engine
    if eng is None:
        raise ValueError(_NOT_INIT)
    return eng


def rank() -> int:
    return communicator().rank


def size() -> int:
    return communicator().size


def local_rank() -> int:
    return communicator().local_rank


def local_size() -> int:
    return communicator().local_size


def cross_rank() -> int:
    return communicator().cross_rank


def cross_size() -> int:
    return communicator().cross_size


def is_homogeneous() -> bool:
    """Whether every host runs the same number of ranks."""
    topo = communicator().backend.topology
    counts = [topo.hosts.count(h) for h in topo.host_order]
    return len(set(counts)) == 1


def op_name(kind: str, name: Optional[str]) -> str:
    """Horovod's naming: 'allreduce.<name>', or 'allreduce.noname.<n>' in call order."""
    if name is not None:
        return f"{kind}.{name}"
    counter = _counters.setdefault(kind, itertools.count())
    return f"{kind}.noname.{next(counter)}"


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a Chrome-trace timeline (rank 0 writes it)."""
    engine().start_timeline(file_path, mark_cycles=mark_cycles)


def stop_timeline() -> None:
    engine().stop_timeline()


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
    bytes_reduced and bytes_reduced_per_step; tensors_reduced; and the
    engine's counters (cycles, negotiations, fused_buffers, coordination_s...).
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
    out.update({f"engine_{k}": v for k, v in eng.items()})
    if reset:
        last = _steps["_last"]
        _reset_steps()
        _steps["_last"] = last
    return out
