"""Process-global state of `horovod_spark.tensorflow`: Horovod's basics over one HorovodState.

See `horovod_spark.common.basics` for what init() and shutdown() do; every op of
this package goes through the state's fusion engine.  init() imports
TensorFlow only on a rank with an assigned GPU, to pin it.
"""
from __future__ import annotations

from ..common.basics import HorovodState

__all__ = ["init", "shutdown", "is_initialized", "communicator", "engine", "rank", "size",
           "local_rank", "local_size", "cross_rank", "cross_size", "is_homogeneous",
           "start_timeline", "stop_timeline"]


def _pin_gpu() -> None:
    """On a Spark task's GPU, show TensorFlow that one GPU (what Horovod scripts do with
    tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU"), which still works), so a
    rank does not take memory on its host neighbours' GPUs.  TensorFlow refuses once it
    has initialized its devices: then the script's own call decides."""
    from ..common.basics import gpu_ordinal

    ordinal = gpu_ordinal()
    if ordinal is None:
        return
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if ordinal < len(gpus):
        try:
            tf.config.set_visible_devices(gpus[ordinal], "GPU")
        except RuntimeError:  # devices already initialized
            pass


STATE = HorovodState("horovod_spark.tensorflow", __name__, on_init=_pin_gpu, lane=True)

STATE.bind(globals())  # init, shutdown, rank, size, ... (common.basics.BASICS)


def view(process_set, what: str):
    """The process set an op runs on: None for the global set, else its view
    (`horovod_spark.common.process_sets.SetView`).

    Raises:
        ValueError: not a registered set, or this rank is not one of its members.
    """
    return STATE.process_set(process_set, what)


def engine_of(ps):
    """The engine an op on `ps` (a view, None: the global set) submits to."""
    return engine() if ps is None else ps


def size_of(ps) -> int:
    return size() if ps is None else ps.size


def rank_of(ps) -> int:
    return rank() if ps is None else ps.rank


def root_of(ps, world_root: int, what: str) -> int:
    """A root given as a world rank, as the set numbers it."""
    return int(world_root) if ps is None else ps.root(int(world_root), what)
