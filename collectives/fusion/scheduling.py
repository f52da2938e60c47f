"""Who runs the fusion engine's cycles, and when: the Scheduler.

A rank that holds no pending work sleeps until a local submission (or a
heartbeat, IDLE_S after its last cycle, so that stall reports and shutdowns
still get through), then gives a burst of submissions one cycle time to
gather; a rank that holds pending work cycles every cycle time, counted from
the end of the last coordination so the ranks stay in step.  A synchronous op
(`submit(..., lazy=True)`, then `wait()`) leaves the thread asleep and its
caller *drives* the cycles on its own thread until its handle is done; every
agent takes the one cycle lock, so cycles stay serial and in one order on each
rank.  Why, in the architecture notes (Fusion engine, Who runs the cycles).
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Callable, Dict, Optional, Tuple

import numpy as np

from ..errors import describe

__all__ = ["IDLE_S", "Scheduler"]

IDLE_S = 0.02

Work = Tuple[bool, bool, bool]  # (queued submissions, pending requests, joined or shutting down)


class Scheduler:
    """The cycles' agents: the engine's thread and waiting callers.

    It owns the thread, the wake and kick events and the cycle lock.  What it
    needs from the engine is five callables: `cycle(reraise_interrupts)` runs one
    cycle (a failure stops the engine), `work()` says what the engine holds,
    `last_synced()` when its last coordination ended, `stopped()` whether it has
    stopped, and `on_exit()` runs when the thread ends.
    """

    def __init__(self, cycle: Callable[[bool], None], work: Callable[[], Work],
                 last_synced: Callable[[], float], stopped: Callable[[], bool],
                 on_exit: Callable[[], None], *, cycle_lock, cycle_s: float,
                 metrics: Dict[str, float], rank: int, size: int) -> None:
        self._cycle, self._work, self._last_synced = cycle, work, last_synced
        self._stopped, self._on_exit = stopped, on_exit
        self.cycle_lock = cycle_lock  # one cycle at a time: the thread's, a driver's or the lane's
        self.cycle_s, self._metrics, self.rank, self.size = cycle_s, metrics, rank, size
        self._wake = threading.Event()  # a submission arrived
        self._kick = threading.Event()  # someone waits on a handle: cycle now
        self._count_lock = threading.Lock()
        self._drivers = 0  # callers inside drive(): the thread leaves the cycles to them
        self.owner: Optional[int] = None  # the thread ident of a cycle outside the thread
        self._thread = threading.Thread(target=self._run, name=f"fusion-engine-r{rank}",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def notify(self) -> None:
        """A submission arrived (set() takes a lock and notifies: skip it in a burst)."""
        if not self._wake.is_set():
            self._wake.set()

    def in_own_cycle(self) -> bool:
        """Whether this thread is inside a cycle it runs outside the engine's thread."""
        return self.owner == threading.get_ident()

    def join(self, timeout: float) -> bool:
        """Wait for the engine's thread to end; returns whether it did."""
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    @contextlib.contextmanager
    def handed_cycle(self):
        """This thread holds the cycle lock, taken outside Python (the lane's handover):
        finish the cycle as its owner, then release the lock."""
        self.owner = threading.get_ident()
        try:
            yield
        finally:
            self.owner = None
            self.cycle_lock.release()

    # -- waiting on a handle -----------------------------------------------------
    def on_wait(self, handle, timeout: Optional[float]) -> None:
        """A caller starts waiting on `handle`: run the cycles here, or wake the thread."""
        if self.in_own_cycle():
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
        with self._count_lock:
            self._drivers += 1
        try:
            self._drive_cycles(handle)
        finally:
            with self._count_lock:
                self._drivers -= 1
            queued, pending, _ = self._work()
            if queued or pending:  # others' work is left: the thread takes over
                self._kick.set()

    def _drive_cycles(self, handle) -> None:
        while not handle._done:
            with _CallerCycle(self) as cycle:
                if not cycle.entered:
                    return  # the engine's thread is cycling: it finishes the handle
                if self._stopped() or handle._done:
                    return
                cpu = time.thread_time()
                self._metrics["caller_cycles"] += 1
                self._cycle(True)
                self._metrics["thread_cpu_s"] += time.thread_time() - cpu
            if not handle._done:  # some rank has not submitted it yet: pace like the thread
                delay = self.cycle_s - (time.perf_counter() - self._last_synced())
                if delay > 0:
                    time.sleep(delay)

    # -- the engine's thread ---------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopped():
                kicked = self._wait()
                with self.cycle_lock:
                    if self._stopped():
                        break
                    due = self._due(kicked)
                    if due:
                        cpu = time.thread_time()
                        self._cycle(False)
                        self._metrics["thread_cpu_s"] += time.thread_time() - cpu
                if not due and self._drivers:
                    self._kick.wait(IDLE_S)  # until a driver hands over (or a waiter kicks)
        finally:
            self._on_exit()

    def _due(self, kicked: bool) -> bool:
        """Whether the engine's thread should cycle now: not while a caller drives; new
        work; pending work a cycle time after the last cycle (a caller's counts: two
        agents must not double the ranks' cycle rate) or sooner for a waiter; or a
        heartbeat, IDLE_S without a cycle."""
        if self._drivers:
            return False  # a waiting caller cycles (and so heartbeats) meanwhile
        queued, pending, busy = self._work()
        if queued or busy:
            return True
        since = time.perf_counter() - self._last_synced()
        if pending:
            return kicked or since >= self.cycle_s
        return since >= IDLE_S

    def _wait(self) -> bool:
        """Cycle every cycle time while this rank holds work; else sleep until it gets some.
        Returns whether a waiter kicked.

        A rank that holds nothing cannot make any tensor ready (each needs every
        rank's submission), so only the ranks with pending work keep cycling; the
        others join them as soon as they submit, or at the heartbeat.
        """
        _, pending, busy = self._work()
        if pending or busy:
            # Counted from the end of the last coordination, which every rank left at
            # nearly the same moment: the ranks' cycles stay in step and nobody spins
            # long in the next coordination waiting for a peer.
            delay = self.cycle_s - (time.perf_counter() - self._last_synced())
            if delay > 0:
                self._kick.wait(delay)
        else:
            self._wake.clear()
            idle = IDLE_S - (time.perf_counter() - self._last_synced())  # callers' cycles count too
            # (a caller may have drained the queue into the pending set meanwhile: look again)
            queued, pending, _ = self._work()
            if not (queued or pending) and self._wake.wait(max(idle, 0.0)) and self.cycle_s > 0:
                self._kick.wait(self.cycle_s)  # let a burst of submissions gather
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

    __slots__ = ("_sched", "entered", "_undo")

    def __init__(self, sched: Scheduler) -> None:
        self._sched, self.entered, self._undo = sched, False, []

    def __enter__(self) -> "_CallerCycle":
        self.entered = self._sched.cycle_lock.acquire(blocking=False)
        if not self.entered:
            return self
        self._sched.owner = threading.get_ident()
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
            self._sched.owner = None
            self._sched.cycle_lock.release()


_NUMPY_DEFAULT_ERR = {"divide": "warn", "over": "warn", "under": "ignore", "invalid": "warn"}
