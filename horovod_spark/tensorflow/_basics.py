"""Process-global state of the Horovod-style API: one communicator per process.

`init()` makes it from the rank environment the launcher set (the local
launcher, the Spark task, or mpiexec; a world of one otherwise) and, when the
fusion engine is available, starts one engine over it, so named ops from any
thread are negotiated, fused and timed like torch's.  `shutdown()` releases
both.  Nothing here imports a framework.
"""
from __future__ import annotations

import atexit
import threading
from typing import Optional

import collectives

__all__ = ["init", "shutdown", "is_initialized", "communicator", "engine", "rank", "size",
           "local_rank", "local_size", "cross_rank", "cross_size"]

_lock = threading.Lock()
_comm: Optional["collectives.Communicator"] = None
_engine = None


def init(config: Optional["collectives.Config"] = None) -> None:
    """Join the job.  Calling it again while initialized does nothing."""
    global _comm, _engine
    with _lock:
        if _comm is not None:
            return
        comm = collectives.init(config)
        _engine = _start_engine(comm)
        _comm = comm


def _start_engine(comm):
    try:
        from collectives.fusion import FusionEngine
    except ImportError:  # an install without the engine: ops go to the communicator
        return None
    return FusionEngine(comm, comm.config)


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
        raise ValueError("horovod_spark has not been initialized; call hvd.init() first")
    return comm


def engine():
    """The fusion engine, or None when this install has none."""
    communicator()
    return _engine


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
