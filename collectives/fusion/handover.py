"""The lane's handover: what the native lane cannot finish comes back to the engine here.

Terms.  The *lane* (`lane.Lane`) runs an armed op's cycle in C++; its *codes* say how a
run ended.  A *handover* is a cycle the lane coordinated but cannot finish (a peer
announced, joined, asked for a stall report, or stops): the thread holds the cycle lock,
which the lane took, and the engine finishes that cycle from the lane's summed vector.  An
*async op in the lane* is an in-place allreduce queued there with a *ticket*; the lane's
batch cycles run it, unless the engine *takes the queue over* (its ops become the engine's
requests, in order).  One rule keeps the lane's cycles and Python's from starving each
other: a rank's pending work is all in one place.  An op enters the lane's queue only while
the engine holds nothing (under the engine's lock), and anything submitted to the engine
first takes the lane's queue over (`lock_engine`), so every cycle of this rank contributes
every op it has, as Python's cycle alone would.

What `LaneHandover` needs of its engine (`engine.FusionEngine`): `rank`, `size`, `lock`,
`sched` (the Scheduler), `holds(name)` (whether it holds work, or that name), `enter(reqs,
pending)` (requests in, queued or pending; the stop it found, if any), `submit`,
`raise_if_stopped`, `stop`, and `run_handed_cycle(vec, t0)` (the rest of a cycle from a
summed vector).  The engine holds one, as it holds its Scheduler, and its lane-facing
methods (`lane_op`, `lane_enqueue`, `lane_wait`, `lane_poll`) are this room's.
"""
from __future__ import annotations

import time
from typing import Dict

import numpy as np

from ..errors import CollectiveError, describe
from ..types import ReduceOp
from .handle import Handle
from .lane import Lane, codes as lane_codes
from .request import make_request

__all__ = ["LaneHandover", "DONE"]


class _Finished:
    """A lane op found done by a poll: what a later wait finds in its place."""

    @staticmethod
    def poll() -> bool:
        return True

    @staticmethod
    def wait(timeout=None) -> None:
        return None


DONE = _Finished()


class LaneHandover:
    """The engine's side of its lane (see the module docstring)."""

    def __init__(self, engine, lane: Lane) -> None:
        self.engine, self.lane = engine, lane
        self._done = lane_codes()["done"]
        # async ops queued in the lane: ticket -> (name, tensor, op, postscale); once the
        # engine took them over, ticket -> the request's handle
        self._ops: Dict[int, tuple] = {}
        self._flushed: Dict[int, Handle] = {}

    # -- blocking ops ----------------------------------------------------------------
    def lane_op(self, code: int, slot: int, name: str, src: np.ndarray, dst: np.ndarray,
                op: ReduceOp, postscale: float = 1.0) -> None:
        """Finish an allreduce of src into dst that `lane.run(slot, src, dst)` returned
        `code` for: fall back to `submit` and arm the slot, finish a cycle the lane handed
        over, or stop on the lane's error.  Raises as `wait` does."""
        known = lane_codes()
        if code == known["handover"]:
            return self._handover(name, src, dst, op, postscale)
        if code == known["error"]:
            self._raise_lane_error(name)
        handle = self.engine.submit(name, "allreduce", src, out=dst, op=op, postscale=postscale,
                                    lazy=True)
        handle.wait()
        self.lane.arm(slot, handle._sig, src, postscale, self.engine.size)

    def _raise_lane_error(self, name: str, take_queue: bool = False) -> None:
        eng = self.engine
        try:
            self.lane.raise_error()
        except CollectiveError as exc:
            err = type(exc)(describe(str(exc), rank=eng.rank, size=eng.size, op="allreduce",
                                     tensor=f"'{name}'"))
            eng.stop(type(exc), f"the fusion engine stopped after a failure: "
                     f"{type(exc).__name__}: {err}", exc)
            if take_queue:
                self.take_over(handed_over=False)  # the others queued fail with it
            raise err from exc

    def _handover(self, name: str, src, dst, op: ReduceOp, postscale: float) -> None:
        """This thread holds the cycle lock, taken by the lane, which coordinated: enter
        the op as a pending request, finish the cycle from the summed vector, wait."""
        eng = self.engine
        t0 = time.perf_counter()
        with eng.sched.handed_cycle():
            try:
                req = make_request(name, "allreduce", src, dst, op, 1.0, postscale, 0, None, None,
                                   eng.rank, eng.size, eng.sched.on_wait)
            except Exception as exc:  # the peers are inside this cycle: leave it stopped, not half-done
                eng.stop(CollectiveError, f"the fusion engine stopped after a failure: "
                         f"{type(exc).__name__}: {exc}", exc)
                raise
            # not announced: the lane set its cached bit, and if a peer's new signature for
            # this name evicts that bit in this cycle, the request must announce its own next
            # cycle (as a cached request in Python's cycles does), or the name would hang
            # instead of failing as a mismatch.  Async ops queued in the lane meanwhile (not
            # in this cycle's vector) become the engine's first: all pending work in one place.
            self.take_over(handed_over=True)
            with eng.lock:
                eng.raise_if_stopped("allreduce", req.sig.tensor())
            eng.enter([req], pending=True)
            self._finish_handed_cycle(t0)
        req.handle.lazy = True
        req.handle.wait()

    # -- async ops in the lane ----------------------------------------------------------
    def lane_enqueue(self, slot: int, name: str, tensor, ptr: int, nbytes: int, op: ReduceOp,
                     postscale: float) -> int:
        """Queue an in-place async allreduce of `tensor` (at address ptr) in the lane; its
        ticket, or -1 (the slot is not armed: submit, then arm it) or -2 (the engine holds
        work: submit)."""
        if not self.lane.native.armed(slot, nbytes):
            return -1
        with self.engine.lock:
            if self.engine.holds(name):
                return -2
            ticket = self.lane.native.enqueue(slot, ptr, ptr, nbytes)
            if ticket >= 0:
                self._ops[ticket] = (name, tensor, op, postscale)
        return ticket

    def lane_wait(self, ticket: int, budget: float = 2.0) -> None:
        """Wait for a queued op: the lane's batch cycles, or the engine once it took the op
        over (a handover, a stale slot, the lane switched off, `budget` seconds without
        the op done).  Raises as `Handle.wait` does."""
        native = self.lane.native
        code = native.wait(ticket, budget)
        if code == self._done:  # the steady state: nothing else to look up
            self._ops.pop(ticket, None)
            return
        known = lane_codes()
        if code == known["handover"]:
            self._batch_handover()
        elif code == known["error"]:
            name = self._ops.get(ticket, ("?",))[0]
            try:
                self._raise_lane_error(name, take_queue=True)
            finally:
                self._flushed.pop(ticket, None)
                self._ops.pop(ticket, None)
        if code != known["done"] and not native.done(ticket):
            if ticket not in self._flushed:
                self.take_over(handed_over=False)
            handle = self._flushed.pop(ticket, None)
            name = self._ops.pop(ticket, ("?",))[0]
            if handle is not None:
                handle.wait()
                return
            if not native.done(ticket):  # (unless a cycle ran it meanwhile)
                self.engine.raise_if_stopped("allreduce", f"'{name}'")
                raise CollectiveError(describe(
                    "internal error: the op left the lane's queue without a result",
                    rank=self.engine.rank, size=self.engine.size, op="allreduce",
                    tensor=f"'{name}'"))
        self._ops.pop(ticket, None)

    def lane_poll(self, ticket: int) -> bool:
        """Whether a queued op is done; if not, the engine takes the lane's queue over (its
        thread makes progress, as for any async op nobody waits for)."""
        if ticket in self._flushed:
            return self._flushed[ticket].poll()
        if self.lane.native.done(ticket):
            self._ops.pop(ticket, None)
            self._flushed[ticket] = DONE
            return True
        self.take_over(handed_over=False)
        return self.lane_poll(ticket) if ticket in self._flushed else False

    def lock_engine(self) -> None:
        """Take the engine's lock with the lane's queue empty: the queued ops become the
        engine's requests first (in their order, before what the caller adds)."""
        lock, native = self.engine.lock, self.lane.native
        while True:
            if native.queued:
                self.take_over(handed_over=False)
            lock.acquire()
            if not native.queued:
                return
            lock.release()  # an op entered the lane meanwhile: it goes first

    def take_over(self, handed_over: bool) -> None:
        """The lane's queued ops become requests of the engine, in order: queued for the next
        cycle, or (`handed_over`: this thread holds the cycle lock the lane took, inside
        the cycle it coordinated, which contributed them) pending without an announcement,
        as `_handover` enters its one op."""
        eng, lock = self.engine, self.lane.lock
        if not handed_over:
            lock.acquire()
        try:
            reqs = []
            for ticket in self.lane.native.take_queue():
                name, tensor, op, post = self._ops.get(ticket, (None,) * 4)
                try:
                    if name is None:
                        raise CollectiveError(f"internal error: lane ticket {ticket} has no op")
                    req = make_request(name, "allreduce", tensor, tensor, op, 1.0, post, 0, None,
                                       None, eng.rank, eng.size, eng.sched.on_wait)
                except Exception as exc:  # (the tensor changed since): its wait raises why
                    failed = Handle(name or "?", "allreduce", eng.rank, eng.size)
                    failed._finish(None, exc)
                    self._flushed[ticket] = failed
                    continue
                self._flushed[ticket] = req.handle
                reqs.append(req)
            stopped = eng.enter(reqs, pending=handed_over)
        finally:
            if not handed_over:
                lock.release()
        if stopped is not None:  # no cycle will run them: they fail with the engine's cause
            cls, text, _ = stopped
            for req in reqs:
                req.handle._finish(None, cls(describe(text, rank=eng.rank, size=eng.size,
                                                      op="allreduce", tensor=req.sig.tensor())))
        elif reqs and not handed_over:
            eng.sched.notify()

    def _batch_handover(self) -> None:
        """The lane's batch cycle was not the lane's to finish (a peer joined, announced, asked
        for a stall report, stops): its queue becomes the engine's, which finishes the cycle."""
        eng = self.engine
        t0 = time.perf_counter()
        with eng.sched.handed_cycle():
            try:
                self.take_over(handed_over=True)
            except Exception as exc:  # the peers are inside this cycle: leave it stopped
                eng.stop(CollectiveError, f"the fusion engine stopped after a failure: "
                         f"{type(exc).__name__}: {exc}", exc)
                raise
            self._finish_handed_cycle(t0)

    def _finish_handed_cycle(self, t0: float) -> None:
        """The rest of the cycle the lane coordinated and handed over (its pending requests
        entered): from the lane's summed vector on, as a Python cycle goes on."""
        self.lane.sync()  # the bits the lane ran before this cycle count as used first,
        self.engine.run_handed_cycle(self.lane.result(), t0)  # as a Python cycle marks them
