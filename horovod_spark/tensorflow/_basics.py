"""Process-global state of `horovod_spark.tensorflow`: Horovod's basics over one HorovodState.

See `horovod_spark._common` for what init() and shutdown() do; every op of
this package goes through the state's fusion engine.  Nothing here imports
a framework.
"""
from __future__ import annotations

from .._common import HorovodState

__all__ = ["init", "shutdown", "is_initialized", "communicator", "engine", "rank", "size",
           "local_rank", "local_size", "cross_rank", "cross_size", "is_homogeneous",
           "start_timeline", "stop_timeline"]

STATE = HorovodState("horovod_spark.tensorflow", __name__)

init, shutdown, is_initialized = STATE.init, STATE.shutdown, STATE.is_initialized
communicator, engine = STATE.communicator, STATE.engine
rank, size, local_rank, local_size = STATE.rank, STATE.size, STATE.local_rank, STATE.local_size
cross_rank, cross_size, is_homogeneous = STATE.cross_rank, STATE.cross_size, STATE.is_homogeneous
start_timeline, stop_timeline = STATE.start_timeline, STATE.stop_timeline
