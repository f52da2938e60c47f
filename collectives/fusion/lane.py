"""The lane: an op's steady-state cycle in C++, for callers outside Python (the C++
half is `hvs::Lane`, native/src/lane).

A caller that is not Python (horovod_spark.tensorflow's allreduce op) runs an
allreduce as `lane.run(slot, ...)` with no Python at all once its slot is *armed*;
otherwise it calls `FusionEngine.lane_op` with the code the lane returned
(`CODES`: fallback, handover, error).  `Lane` is the engine's collaborator that
keeps the native lane in step with the engine's response cache; the engine
decides when the lane is on and finishes what the lane hands over.  The scheme is
in docs/architecture.md (The lane).
"""
from __future__ import annotations

import functools
from typing import Dict, Optional

import numpy as np

from ..types import DType, ReduceOp, dtype_of_numpy

__all__ = ["Lane", "CODES", "run_address"]

_LANES: list = []  # every lane ever made: a TensorFlow graph may hold its address
_SCALABLE = (DType.FLOAT16, DType.FLOAT32, DType.FLOAT64)  # the dtypes whose postscale the lane applies


def _native():
    from .. import _native as native  # built by setup.py; only the native backend needs it

    return native


@functools.lru_cache(maxsize=None)
def _codes() -> tuple:
    return tuple(_native().LANE_CODES.items())


def codes() -> Dict[str, int]:
    """What `run` and `wait` return: done, fallback, handover, error."""
    return dict(_codes())


def run_address() -> int:
    """The address of the C function `run(lane, slot, src, dst, nbytes)`, for a caller
    outside Python (the TensorFlow op binds it with a lane's `address`)."""
    return _native().LANE_RUN


class Lane:
    """The engine's side of the native lane: the cache's changes and the armed slots.

    The native lane's lock is the engine's cycle lock; Python's cycles tell it which
    bits of the response cache changed (the slots armed on them go stale; the others
    keep running) and mark the bits it ran as used, oldest first, so the cache's LRU
    order stays the same on every rank.
    """

    def __init__(self, native, cache) -> None:
        self.native, self._cache = native, cache
        self.generation, self._version = 0, -1
        self._base = dict.fromkeys(("cycles", "tensors", "bytes", "collective_s"), 0)
        native.set_cache(0, 0, [])

    @classmethod
    def make(cls, comm, cache) -> Optional["Lane"]:
        """A lane over comm's native context, or None (another backend, or none built)."""
        ctx = comm.backend.native_context
        if ctx is None:
            return None
        native = _native().Lane(ctx)
        _LANES.append(native)
        return cls(native, cache)

    @property
    def lock(self):
        return self.native.lock

    @property
    def synced(self) -> float:
        """When the lane's last coordination ended."""
        return self.native.synced

    def sync(self) -> None:
        """At the start of a Python cycle: the cache bits the lane ran count as used."""
        for _, bit in self.native.take_uses():
            self._cache.at(bit)

    def cache_changed(self) -> None:
        """After a negotiation: the slots armed on bits that changed go stale."""
        if self._cache.version != self._version:
            self._version = self._cache.version
            self.generation += 1
            self.native.set_cache(len(self._cache), self.generation, self._cache.take_changed())

    def set_enabled(self, on: bool) -> None:
        self.native.set_enabled(on)

    def add_metrics(self, out: dict, reset: bool) -> None:
        """Count the lane's cycles in the engine's metrics `out`; adds lane_cycles."""
        lane = self.native
        now = {"cycles": lane.cycles, "tensors": lane.tensors, "bytes": lane.bytes,
               "collective_s": lane.collective_s}
        d = {k: now[k] - self._base[k] for k in now}
        out["lane_cycles"] = d["cycles"]
        out["lane_tensors"] = d["tensors"]
        for key in ("cycles", "collectives"):
            out[key] += d["cycles"]
        for key in ("tensors", "allreduce_tensors"):
            out[key] += d["tensors"]
        out["allreduce_bytes"] += d["bytes"]
        out["collective_s"] += d["collective_s"]
        if reset:
            self._base = now

    def arm(self, slot: int, sig, src: np.ndarray, postscale: float, size: int) -> None:
        """After an allreduce with signature `sig` ran through the engine: arm `slot` with
        sig's cache bit, if the cache holds sig (the exact signature, so the lane reduces
        what the other ranks' engines do).  The generation is read before the cache: if
        the cache changes before the native lane takes the arm, it refuses it."""
        dtype = dtype_of_numpy(src.dtype)
        if (slot < 0 or dtype not in _SCALABLE or sig is None or sig.kind != "allreduce"
                or sig.dtype != int(dtype) or sig.count != src.size or sig.prescale != 1.0
                or sig.postscale != postscale):
            return
        gen = self.generation
        bit: Optional[int] = 0 if size == 1 else self._cache.bit(sig)
        if bit is None:
            return
        post = postscale / size if ReduceOp(sig.op) == ReduceOp.AVERAGE else postscale
        self.native.arm(slot, bit, int(src.size), int(dtype), float(post), gen)

    def result(self) -> np.ndarray:
        """The coordination vector the lane summed before it handed the cycle over."""
        return np.asarray(self.native.result(), np.int32)

    def raise_error(self) -> None:
        self.native.raise_error()

    def close(self, timeout: float) -> None:
        self.native.close(timeout)
