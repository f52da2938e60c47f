"""The lane: an op's steady-state cycle in C++, for callers outside Python (a mixin of
FusionEngine; the C++ half is native/src/lane/lane.h).

A caller that is not Python (the TensorFlow op of horovod_spark.tensorflow) runs an
allreduce as `lane.run(slot, ...)` with no Python at all once its slot is *armed*;
otherwise it calls `lane_op` with the code the lane returned:

  fallback  the slot is not armed (first run, the cache moved, the lane is off):
            the op goes through `submit` and `wait` like any other, and then its slot
            is armed with the bit its signature got in the response cache
  handover  the lane ran the coordination allreduce and the sum needs the engine
            (a peer joined, announced, asked for a stall report, holds other work):
            the caller holds the cycle lock; the op becomes a pending request and
            `_cycle_rest` finishes that cycle from the summed vector, then the op
            waits like any other
  error     a collective failed in the lane: the engine stops with that cause

So the lane never decides anything the engine would decide differently.  It is
off while this rank has joined, is shutting down, writes a timeline, or has
stopped.  The engine's cycle lock is the lane's (`_native.CycleLock`), and
Python's cycles tell the lane when the response cache changed (stale slots fall
back) and mark the bits the lane ran as used, oldest first, so the cache's LRU
order stays the same on every rank.
"""
from __future__ import annotations

import threading
import time
from typing import Optional

import numpy as np

from ..errors import CollectiveError, describe
from ..types import DType, ReduceOp, dtype_of_numpy
from .request import make_request

__all__ = ["LaneMixin", "make_lane"]

_LANES: list = []  # every lane ever made: a TensorFlow graph may hold its address
_SCALABLE = (DType.FLOAT16, DType.FLOAT32, DType.FLOAT64)  # the dtypes whose postscale the lane applies


def make_lane(comm):
    """A lane over comm's native context, or None (another backend, or none built)."""
    ctx = getattr(comm.backend, "_ctx", None)
    if ctx is None:
        return None
    from .. import _native

    lane = _native.Lane(ctx)
    _LANES.append(lane)
    return lane


class LaneMixin:
    """The engine's side of the lane.  Uses the engine's state (engine.py)."""

    _lane = None

    def _lane_init(self, lane) -> None:
        self._lane = lane
        self._lane_gen, self._lane_version = 0, -1
        self._lane_base = dict.fromkeys(("cycles", "bytes", "collective_s"), 0)
        if lane is not None:
            lane.set_cache(0, 0)

    @property
    def lane(self):
        """The native lane (`_native.Lane`), or None."""
        return self._lane

    def _last_synced(self) -> float:
        """When this rank's last coordination ended (Python's cycles or the lane's)."""
        if self._lane is None:
            return self._synced
        return max(self._synced, self._lane.synced)

    def _lane_sync(self) -> None:
        """At the start of a Python cycle: the cache bits the lane ran count as used."""
        for _, bit in self._lane.take_uses():
            self._cache.at(bit)

    def _lane_cache_changed(self) -> None:
        """After a negotiation: a changed cache makes every armed slot stale."""
        if self._cache.version != self._lane_version:
            self._lane_version = self._cache.version
            self._lane_gen += 1
            self._lane.set_cache(len(self._cache), self._lane_gen)

    def _lane_update(self) -> None:
        """The lane runs only while the engine would contribute its plain vector."""
        if self._lane is not None:
            self._lane.set_enabled(not (self._joined or self._shutdown_requested or self._stopped
                                        or self._executor.timeline is not None))

    def _lane_metrics(self, out: dict, reset: bool) -> None:
        lane = self._lane
        now = {"cycles": lane.cycles, "bytes": lane.bytes, "collective_s": lane.collective_s}
        d = {k: now[k] - self._lane_base[k] for k in now}
        out["lane_cycles"] = d["cycles"]
        for key in ("cycles", "tensors", "allreduce_tensors", "collectives"):
            out[key] += d["cycles"]
        out["allreduce_bytes"] += d["bytes"]
        out["collective_s"] += d["collective_s"]
        if reset:
            self._lane_base = now

    # -- the caller's side -------------------------------------------------------
    def lane_op(self, code: int, slot: int, name: str, src: np.ndarray, dst: np.ndarray,
                op: ReduceOp, postscale: float = 1.0) -> None:
        """Finish an allreduce of src into dst that `lane.run(slot, src, dst)` returned
        `code` for (see the module's docstring).  Raises as `wait` does."""
        from .. import _native

        codes = _native.LANE_CODES
        if code == codes["handover"]:
            return self._lane_handover(name, src, dst, op, postscale)
        if code == codes["error"]:
            try:
                self._lane.raise_error()
            except CollectiveError as exc:
                err = type(exc)(describe(str(exc), rank=self.rank, size=self.size, op="allreduce",
                                         tensor=f"'{name}'"))
                self._stop(type(exc), f"the fusion engine stopped after a failure: "
                           f"{type(exc).__name__}: {err}", exc)
                raise err from exc
        gen = self._lane_gen
        handle = self.submit(name, "allreduce", src, out=dst, op=op, postscale=postscale, lazy=True)
        handle.wait()
        self._lane_arm(slot, name, src, op, postscale, gen)

    def _lane_arm(self, slot: int, name: str, src: np.ndarray, op: ReduceOp, postscale: float,
                  gen: int) -> None:
        if self._lane is None or slot < 0:
            return
        if dtype_of_numpy(src.dtype) not in _SCALABLE:
            return
        if self.size == 1:
            bit: Optional[int] = 0
        else:
            sig = self._cache.by_name(name)
            bit = None if sig is None else self._cache.bit(sig)
        if bit is None:
            return
        post = postscale / self.size if ReduceOp(op) == ReduceOp.AVERAGE else postscale
        self._lane.arm(slot, bit, int(src.size), int(dtype_of_numpy(src.dtype)), float(post), gen)

    def _lane_handover(self, name: str, src, dst, op: ReduceOp, postscale: float) -> None:
        """This thread holds the cycle lock, taken by the lane, which coordinated: enter
        the op as a pending request, finish the cycle from the summed vector, wait."""
        t0 = time.perf_counter()
        self._cycle_owner = threading.get_ident()
        try:
            try:
                req = make_request(name, "allreduce", src, dst, op, 1.0, postscale, 0, None, None,
                                   self.rank, self.size, self._on_wait)
            except Exception as exc:  # the peers are inside this cycle: leave it stopped, not half-done
                self._stop(CollectiveError, f"the fusion engine stopped after a failure: "
                           f"{type(exc).__name__}: {exc}", exc)
                raise
            req.announced = True  # cached: the lane set its bit
            with self._lock:
                self._raise_if_stopped("allreduce", req.sig.tensor())
                self._live[name] = req
            self._pending[name] = req
            self._cycle_no += 1
            self._metrics["lane_handovers"] += 1
            vec = np.asarray(self._lane.result(), np.int32)
            self._guarded_cycle(body=lambda: self._cycle_rest(vec, b"", t0))
        finally:
            self._cycle_owner = None
            self._cycle_lock.release()
        req.handle.lazy = True
        req.handle.wait()

