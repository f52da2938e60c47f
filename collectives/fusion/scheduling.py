"""Who runs the fusion engine's cycles, and when (a mixin of FusionEngine).

A rank that holds no pending work sleeps until a local submission (or a
heartbeat, IDLE_S after its last cycle, so that stall reports and shutdowns
still get through), then gives a burst of submissions one cycle time to
gather before it coordinates; a rank that holds pending work cycles every
cycle time, counted from the end of the last coordination so the ranks stay
in step.

*Caller-driven cycles.*  A synchronous op (`submit(..., lazy=True)`, then
`wait()`) leaves the engine's thread asleep: its caller has nothing more to
submit for now, so it runs the cycles itself, on its own thread, while no
other cycle runs, until its handle is done (the engine's thread and every
driver take one cycle lock, so cycles stay serial and in one order on each
rank).  That saves two thread wake-ups per op, which in a training step cost
more than the cycle itself.  Asynchronous submissions wake the engine's
thread, which runs their cycles while the caller goes on (overlap), and a
wait on them only kicks it: two agents taking turns at the cycles cost more
than either.  A wait with a timeout also stays with the engine's thread.
CUDA ops run the same on either thread: on the engine stream, ordered after
their producers and before their consumers by events (_streams.py).
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Optional

import numpy as np

from ..errors import CollectiveError, describe

__all__ = ["IDLE_S", "Scheduling"]

log = logging.getLogger("collectives.fusion")

IDLE_S = 0.02


class Scheduling:
    """The cycles' agents: the engine's thread (`_run`) and waiting callers (`_drive`).

    Uses the engine's state: its locks and events, queue, pending table,
    `_cycle`, `_stop` and metrics (engine.py)."""

    # -- waiting on a handle -----------------------------------------------------
    def _on_wait(self, handle, timeout: Optional[float]) -> None:
        """A caller starts waiting on `handle`: run the cycles here, or wake the thread."""
        if self._cycle_owner == threading.get_ident():
            raise RuntimeError(describe(
                f"{handle.kind} '{handle.name}' was waited for inside this thread's own fusion "
                "cycle, which can't end before it (a signal handler that runs a collective?)",
                rank=self.rank, size=self.size, op=handle.kind,
                hint="in a signal handler, set a flag and run the collective from the loop"))
        if timeout is None and handle.lazy:
            self._drive(handle)
        if not handle._done:
            self._wake.set()
            self._kick.set()  # the caller has nothing more to submit: no need to wait out the cycle time

    def _drive(self, handle) -> None:
        """Cycle on this thread until `handle` is done, while no other cycle runs."""
        with self._lock:
            self._drivers += 1
        try:
            self._drive_cycles(handle)
        finally:
            with self._lock:
                self._drivers -= 1
            if self._queue or self._pending:  # others' work is left: the thread takes over
                self._kick.set()

    def _drive_cycles(self, handle) -> None:
        while not handle._done:
            with _CallerCycle(self) as cycle:
                if not cycle.entered:
                    return  # the engine's thread is cycling: it finishes the handle
                if self._stopped is not None or handle._done:
                    return
                cpu = time.thread_time()
                self._metrics["caller_cycles"] += 1
                self._guarded_cycle(reraise_interrupts=True)
                self._metrics["thread_cpu_s"] += time.thread_time() - cpu
            if not handle._done:  # some rank has not submitted it yet: pace like the thread
                delay = self._cycle_s - (time.perf_counter() - self._last_synced())
                if delay > 0:
                    time.sleep(delay)

    # -- the engine's thread ---------------------------------------------------
    def _run(self) -> None:
        try:
            while self._stopped is None:
                kicked = self._wait()
                with self._cycle_lock:
                    if self._stopped is not None:
                        break
                    due = self._due(kicked)
                    if due:
                        cpu = time.thread_time()
                        self._guarded_cycle()
                        self._metrics["thread_cpu_s"] += time.thread_time() - cpu
                if not due and self._drivers:
                    self._kick.wait(IDLE_S)  # until a driver hands over (or a waiter kicks)
        finally:
            self.stop_timeline()

    def _guarded_cycle(self, reraise_interrupts: bool = False, body=None) -> None:
        """Run one cycle (or `body`, the rest of one: lane.py); a failure stops the engine."""
        try:
            (body or self._cycle)()
        except BaseException as exc:  # the cause goes to every waiting handle
            log.debug("fusion engine on rank %d stopped: %r", self.rank, exc)
            cls = type(exc) if isinstance(exc, CollectiveError) else CollectiveError
            self._stop(cls, f"the fusion engine stopped after a failure: {type(exc).__name__}: {exc}",
                       exc)
            if reraise_interrupts and not isinstance(exc, Exception):
                raise

    def _due(self, kicked: bool) -> bool:
        """Whether the engine's thread should cycle now: not while a caller drives; new
        work; pending work a cycle time after the last cycle (a caller's counts: two
        agents must not double the ranks' cycle rate) or sooner for a waiter; or a
        heartbeat, IDLE_S without a cycle."""
        if self._drivers:
            return False  # a waiting caller cycles (and so heartbeats) meanwhile
        if self._queue or self._joined or self._shutdown_requested:
            return True
        since = time.perf_counter() - self._last_synced()
        if self._pending:
            return kicked or since >= self._cycle_s
        return since >= IDLE_S

    def _wait(self) -> bool:
        """Cycle every cycle time while this rank holds work; else sleep until it gets some.
        Returns whether a waiter kicked.

        A rank that holds nothing cannot make any tensor ready (each needs every
        rank's submission), so only the ranks with pending work keep cycling; the
        others join them as soon as they submit, or at the heartbeat.
        """
        if self._pending or self._joined or self._shutdown_requested:
            # Counted from the end of the last coordination, which every rank left at
            # nearly the same moment: the ranks' cycles stay in step and nobody spins
            # long in the next coordination waiting for a peer.
            delay = self._cycle_s - (time.perf_counter() - self._last_synced())
            if delay > 0:
                self._kick.wait(delay)
        else:
            self._wake.clear()
            idle = IDLE_S - (time.perf_counter() - self._last_synced())  # callers' cycles count too
            # (a caller may have drained the queue into _pending meanwhile: look again)
            if not (self._queue or self._pending) and self._wake.wait(max(idle, 0.0)) and \
                    self._cycle_s > 0:
                self._kick.wait(self._cycle_s)  # let a burst of submissions gather
        kicked = self._kick.is_set()
        self._kick.clear()
        return kicked


class _CallerCycle:
    """The cycle lock for one cycle on a waiting caller's thread (`entered`: got it).

    The cycle runs with numpy's default error handling and, when torch is in use,
    outside inference mode, as on the engine's thread: the handles it finishes may
    be other threads'.  The owner is recorded, so that a wait nested in the cycle
    (a signal handler that runs a collective) fails instead of deadlocking.
    """

    __slots__ = ("_engine", "entered", "_undo")

    def __init__(self, engine: Scheduling) -> None:
        self._engine, self.entered, self._undo = engine, False, []

    def __enter__(self) -> "_CallerCycle":
        self.entered = self._engine._cycle_lock.acquire(blocking=False)
        if not self.entered:
            return self
        self._engine._cycle_owner = threading.get_ident()
        if np.geterr() != _NUMPY_DEFAULT_ERR:
            self._undo.append(np.errstate(**_NUMPY_DEFAULT_ERR))
        torch = sys.modules.get("torch")
        if torch is not None and torch.is_inference_mode_enabled():
            self._undo.append(torch.inference_mode(False))
        for ctx in self._undo:
            ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if not self.entered:
            return
        try:
            for ctx in reversed(self._undo):
                ctx.__exit__(None, None, None)
        finally:
            self._engine._cycle_owner = None
            self._engine._cycle_lock.release()


_NUMPY_DEFAULT_ERR = {"divide": "warn", "over": "warn", "under": "ignore", "invalid": "warn"}
