"""Process-global state of the Horovod-style API: one communicator, one fusion engine.

`init()` makes the communicator from the rank environment the launcher set
(the local launcher, the Spark task, or mpiexec; a world of one otherwise)
and starts the fusion engine over it; every op of this package goes through
that engine, so ops from any thread are negotiated, fused and timed like
torch's.  `shutdown()` stops the engine on every rank and closes the
communicator.  Nothing here imports a framework.
"""
from __future__ import annotations

import atexit
import threading
from typing import Optional

import collectives
from collectives.fusion import FusionEngine

__all__ = ["init", "shutdown", "is_initialized", "communicator", "engine", "rank", "size",
           "local_rank", "local_size", "cross_rank", "cross_size", "is_homogeneous",
           "start_timeline", "stop_timeline"]

_lock = threading.Lock()
_comm: Optional["collectives.Communicator"] = None
_engine: Optional[FusionEngine] = None
_NOT_INIT = "horovod_spark.tensorflow has not been initialized; call hvd.init() first"


def init(comm: Optional["collectives.Communicator"] = None,
         config: Optional["collectives.Config"] = None) -> None:
    """Join the job.  Calling it again while initialized does nothing.

    Args:
        comm: an existing collectives.Communicator to use instead of building one.
        config: a collectives.Config; by default built from the HOROVOD_* variables.
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


def shutdown() -> None:
    """Leave the job: finish the engine's work and close the communicator."""
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


def communicator() -> "collectives.Communicator":
    """The communicator, or ValueError when init() has not been called."""
    comm = _comm
    if comm is None:
        raise ValueError(_NOT_INIT)
    return comm


def engine() -> FusionEngine:
    """The fusion engine, or ValueError when init() has not been called."""
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


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Write a Chrome-trace timeline of every op to file_path (rank 0 writes it)."""
    engine().start_timeline(file_path)


def stop_timeline() -> None:
    engine().stop_timeline()
