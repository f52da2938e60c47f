"""FusionEngine: named async ops, agreed across ranks and fused, in a background thread.

Terms.  A *submission* is one call of `submit` (any thread); it becomes a
*request* (`Request`) that waits in the *pending* table of this rank.  A
*cycle* is one pass of the engine's thread, every `cycle_time_ms`:

1. drain the submissions;
2. *coordinate*: one small allreduce of the coordination vector
   (`coordinator.Layout`) tells every rank which cached signatures are pending on
   every rank, who has joined, who is shutting down, who has something new;
3. *negotiate*, only when some rank has new signatures: one allgather of
   their metadata into the message table (`MessageTable`), where readiness and
   mismatches are decided identically on every rank; agreed signatures enter
   the response cache (`ResponseCache`), so the next time they cost one bit;
4. *execute* the agreed ops in one deterministic order (`Executor`);
5. finish joins, report stalls (`StallWatch`), stop on shutdown.

Who runs the cycles, and when: the Scheduler (the engine's thread, or a
caller that waits on a synchronous op).  The lane (`Lane`) runs an armed op's
cycle in C++ and hands the engine what it cannot decide (`lane_op`).

A failure in a cycle stops the engine and fails every op submitted and not
finished (`_live`) with its cause; the architecture notes (Fusion engine)
tell the rest.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Dict, List, Optional

import numpy as np
from ..errors import CollectiveError, CollectiveTimeout, MismatchError, describe
from ..types import DType, ReduceOp
from . import coordinator as C
from .autotune import Autotuner
from .cache import ResponseCache
from .executor import Executor
from .handle import Handle
from .handover import LaneHandover
from .lane import Lane
from .request import Memo, Request, Signature, make_request
from .scheduling import IDLE_S, Scheduler
from .stall import StallWatch
from .table import MessageTable
from .timeline import Timeline

__all__ = ["FusionEngine", "IDLE_S"]

log = logging.getLogger("collectives.fusion")

_INT32, _SUM = DType.INT32, ReduceOp.SUM


_METRICS = ("cycles", "caller_cycles", "negotiations", "tensors", "allreduce_tensors",
            "allreduce_bytes", "fused_buffers", "collectives", "collective_s", "coordination_s",
            "thread_cpu_s", "lane_handovers")


class FusionEngine:
    """Named async collectives over `comm`, negotiated and fused in a background thread."""

    def __init__(self, comm, config=None, lane: bool = False) -> None:
        """lane: also make the C++ lane (`Lane`) for callers outside Python, where the
        backend is native; its lock becomes the engine's cycle lock."""
        self._comm = comm
        self._config = config if config is not None else comm.config
        self.rank, self.size = comm.rank, comm.size
        self._cycle_s = self._config.cycle_time_ms / 1000.0
        self._lock = threading.Lock()
        self._queue: list = []
        self._live: Dict[str, Request] = {}  # submitted, not finished: what _stop must fail
        self._pending: Dict[str, Request] = {}
        self._memo: Dict[str, Memo] = {}  # name -> its last torch request's checked parts
        self._layout = C.Layout(self.size)
        self._cache = ResponseCache(self._config.cache_capacity)
        self._table = MessageTable(self.size)
        self._metrics: Dict[str, float] = dict.fromkeys(_METRICS, 0)
        timeline = None
        if self._config.timeline and self.rank == 0:
            timeline = Timeline(self._config.timeline, self.rank)
        self._executor = Executor(comm, self._config.fusion_threshold, timeline, self._metrics,
                                  self._done)
        self._joined, self._join_handles, self._join_first = False, [], {}
        self._live_joins: List[Handle] = []
        self._last_joined = (False,) * self.size
        self._shutdown_requested = False
        self._mark_cycles = bool(self._config.timeline_mark_cycles)  # (HOROVOD_TIMELINE_MARK_CYCLES)
        self._stopped: Optional[tuple] = None  # (error class, text, cause)
        self._cycle_no, self._synced = 0, time.perf_counter()
        self._lane: Optional[Lane] = Lane.make(comm, self._cache) if lane else None
        if self._lane is not None:
            self._lane.native.set_threshold(int(self._config.fusion_threshold))
        self._handover = LaneHandover(self, self._lane) if self._lane is not None else None
        self._cuda = False  # True once a CUDA tensor is submitted (its cycles look for them)
        self._stall = StallWatch(comm, self._config, self.rank, self.size)
        self._tuner: Optional[Autotuner] = (Autotuner(comm, self._config, self._tune)
                                            if self._config.autotune else None)
        self._lane_update()
        self._sched = Scheduler(
            self._guarded_cycle, self._work, self._last_synced, lambda: self._stopped is not None,
            self.stop_timeline, cycle_s=self._cycle_s, metrics=self._metrics, rank=self.rank,
            size=self.size,
            cycle_lock=self._lane.lock if self._lane is not None else threading.Lock())
        self._sched.start()

    # -- public API ------------------------------------------------------------
    def submit(self, name: str, kind: str, buffer=None, out=None, op=ReduceOp.SUM,
               prescale: float = 1.0, postscale: float = 1.0, root: int = 0,
               splits=None, dtype=None, lazy: bool = False, strict_join: bool = False) -> Handle:
        """Queue one named op; returns its Handle (wait/poll).

        kind: allreduce, allgather, broadcast, alltoall, reducescatter, barrier or join.
        out: None (a new result), `buffer` itself (in place) or another tensor of its shape.
        dtype: the logical DType of a numpy buffer whose storage dtype differs (bfloat16).
        lazy: the caller waits on the handle right away (after its other submissions):
            leave the engine's thread asleep, the wait runs the cycle on its thread.
        strict_join: an allgather or broadcast fails on every rank still running once any
            rank has joined (Horovod's rule), instead of going among the running ranks.

        Raises:
            ValueError, TypeError: invalid arguments, or `name` is already pending.
            CollectiveError: the engine has stopped (with the cause).
        """
        if kind == "join":
            return self._submit_join()
        args = (kind, op, prescale, postscale, root, splits, dtype, strict_join)
        memo = self._memo.get(name)
        if memo is not None and memo.fits(args, buffer, out):
            req = memo.request(self.rank, self.size, self._sched.on_wait)
        else:
            req = make_request(name, kind, buffer, out, op, prescale, postscale, root, splits,
                               dtype, self.rank, self.size, self._sched.on_wait, strict_join)
            memo = Memo.of(req, args, buffer, out)
            if memo is not None:
                if len(self._memo) >= Memo.LIMIT:
                    self._memo.clear()
                self._memo[name] = memo
        if req.sig.device != "cpu":  # ordered after its producer on the caller's stream
            req.ready = self._executor.streams.ready(req.buf.flat)
            self._cuda = True
        self._lock_without_lane_queue()
        try:
            if self._stopped is not None:
                self._raise_if_stopped(req.sig.kind, req.sig.tensor())
            if name in self._live:
                raise ValueError(f"{kind} '{name}' on rank {self.rank}/{self.size}: an op with this "
                                 "name is already pending; wait for it or use another name")
            self._live[name] = req
            self._queue.append(req)
        finally:
            self._lock.release()
        if lazy:
            req.handle.lazy = True
        else:
            self._sched.notify()
        return req.handle

    def join(self, timeout: Optional[float] = None) -> int:
        """Block until every rank has joined; joined ranks contribute zeros meanwhile.

        Returns the rank that joined last.
        """
        return self._submit_join().wait(timeout)

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """Stop the engine on every rank (the others stop at their next cycle)."""
        self._lock_without_lane_queue()  # the lane's queued ops become the engine's, to finish or fail
        try:
            self._shutdown_requested = True
        finally:
            self._lock.release()
        self._lane_update()
        self._sched.notify()
        if self._sched.in_own_cycle():
            return  # called inside this thread's own cycle (a signal handler): it goes out next
        if not self._sched.join(self._config.timeout + 5.0 if timeout is None else timeout):
            self._stop(CollectiveTimeout, "the fusion engine did not stop within the timeout "
                       "(a peer may be gone)", None)
        if self._lane is not None:  # before the communicator (and the lane's context) goes
            self._lane.close(self._config.timeout + 5.0 if timeout is None else timeout)

    def metrics(self, reset: bool = False) -> dict:
        """Counters since the start or the last reset.

        cycles, caller_cycles (those run by a waiting caller's thread), negotiations
        (full ones), tensors (finished), allreduce_tensors, allreduce_bytes (payload
        reduced on this rank), fused_buffers, collectives (data collectives run),
        collective_s (wall time inside them), coordination_s (wall time agreeing,
        waits for peers included) and thread_cpu_s (CPU time of the cycles, on the
        engine's thread or a caller's).  With a lane, its cycles count in
        cycles, tensors, allreduce_*, collectives and collective_s, and lane_cycles and
        lane_handovers (cycles it coordinated and the engine finished) are added.
        The backend's transport counters follow (shm_ops, shm_bytes, tcp_ops,
        tcp_bytes_sent, tcp_bytes_received: see Communicator.transport_metrics).
        """
        out = dict(self._metrics)
        out.update(self._comm.transport_metrics(reset))
        if self._lane is not None:
            self._lane.add_metrics(out, reset)
        if reset:
            for key in _METRICS:
                self._metrics[key] = 0
        return out

    def start_timeline(self, path: str, mark_cycles: bool = False) -> None:
        """Start writing a Chrome-trace timeline to path (rank 0 only; others ignore it).

        mark_cycles: also mark the start of every cycle (CYCLE_START instants).
        """
        if self.rank == 0:
            self.stop_timeline()
            self._mark_cycles = mark_cycles
            self._executor.timeline = Timeline(path, self.rank)
            self._lane_update()

    def stop_timeline(self) -> None:
        tl, self._executor.timeline = self._executor.timeline, None
        self._lane_update()
        if tl is not None:
            tl.close()

    @property
    def lane(self):
        """The native lane (`_native.Lane`: `run`, `address`), or None."""
        return self._lane.native if self._lane is not None else None

    # -- the lane's callers: its room (handover.py) --------------------------------------
    def lane_op(self, code: int, slot: int, name: str, src: np.ndarray, dst: np.ndarray,
                op: ReduceOp, postscale: float = 1.0) -> None:
        """`LaneHandover.lane_op`: finish an allreduce the lane returned `code` for."""
        self._handover.lane_op(code, slot, name, src, dst, op, postscale)

    def lane_enqueue(self, slot: int, name: str, tensor, ptr: int, nbytes: int, op: ReduceOp,
                     postscale: float) -> int:
        """`LaneHandover.lane_enqueue`; -2 (submit) where the engine has no lane."""
        if self._handover is None:
            return -2
        return self._handover.lane_enqueue(slot, name, tensor, ptr, nbytes, op, postscale)

    def lane_wait(self, ticket: int, budget: float = 2.0) -> None:
        """`LaneHandover.lane_wait`: wait for an op queued in the lane."""
        self._handover.lane_wait(ticket, budget)

    def lane_poll(self, ticket: int) -> bool:
        """`LaneHandover.lane_poll`: whether an op queued in the lane is done."""
        return self._handover.lane_poll(ticket)

    def _lock_without_lane_queue(self) -> None:
        if self._handover is not None:
            self._handover.lock_engine()
        else:
            self._lock.acquire()

    # -- what the lane's room asks of the engine (handover.py's contract) ------------------
    lock = property(lambda self: self._lock)
    sched = property(lambda self: self._sched)

    def holds(self, name: str) -> bool:
        """Whether this rank's engine holds work (queued, pending, `name` in flight), or has
        stopped: an op then goes through it, not the lane's queue."""
        return bool(self._queue or self._pending or name in self._live or
                    self._stopped is not None)

    def enter(self, reqs: list, pending: bool):
        """Requests from the lane, in order: pending (inside a cycle the lane handed over)
        or queued for the next cycle; the stop that kept them out, or None."""
        with self._lock:
            stopped = self._stopped
            for req in reqs if stopped is None else ():
                self._live[req.name] = req
                if pending:
                    self._pending[req.name] = req
                else:
                    self._queue.append(req)
        return stopped

    def raise_if_stopped(self, kind: str, tensor: str) -> None:
        self._raise_if_stopped(kind, tensor)

    def stop(self, cls, text: str, cause) -> None:
        self._stop(cls, text, cause)

    def run_handed_cycle(self, vec, t0: float) -> None:
        """The rest of a cycle the lane coordinated, from its summed vector `vec`."""
        self._cycle_no += 1
        self._metrics["lane_handovers"] += 1
        self._guarded_cycle(body=lambda: self._cycle_rest(vec, b"", t0))

    def _lane_update(self) -> None:
        """The lane runs only while the engine would contribute its plain vector."""
        if self._lane is not None:
            self._lane.set_enabled(not (self._joined or self._shutdown_requested or self._stopped
                                        or self._executor.timeline is not None
                                        or (self._tuner is not None and self._tuner.active)))

    def _tune(self, threshold: int, cycle_ms: float) -> None:
        """Autotune's setting, from the next cycle on (the same cycle on every rank)."""
        self._executor.threshold = threshold
        if self._lane is not None:
            self._lane.native.set_threshold(int(threshold))
        self._cycle_s = self._sched.cycle_s = cycle_ms / 1000.0

    # -- what the scheduler runs and asks ----------------------------------------
    def _guarded_cycle(self, reraise_interrupts: bool = False, body=None) -> None:
        """Run one cycle (or `body`, the rest of one the lane handed over); a failure
        stops the engine."""
        try:
            (body or self._cycle)()
        except BaseException as exc:  # the cause goes to every waiting handle
            log.debug("fusion engine on rank %d stopped: %r", self.rank, exc)
            cls = type(exc) if isinstance(exc, CollectiveError) else CollectiveError
            self._stop(cls, f"the fusion engine stopped after a failure: {type(exc).__name__}: {exc}",
                       exc)
            if reraise_interrupts and not isinstance(exc, Exception):
                raise

    def _work(self) -> tuple:
        """(queued submissions, pending requests, joined or shutting down)."""
        return bool(self._queue), bool(self._pending), self._joined or self._shutdown_requested

    def _last_synced(self) -> float:
        """When this rank's last coordination ended (Python's cycles or the lane's)."""
        if self._lane is None:
            return self._synced
        return max(self._synced, self._lane.synced)

    # -- submission side -------------------------------------------------------
    def _submit_join(self) -> Handle:
        handle = Handle("join", "join", self.rank, self.size, None, self._sched.on_wait)
        self._lock_without_lane_queue()
        try:
            self._raise_if_stopped("join", "join")
            self._queue.append(handle)
            self._live_joins.append(handle)
        finally:
            self._lock.release()
        self._sched.notify()
        return handle

    def _raise_if_stopped(self, kind: str, tensor: str) -> None:
        if self._stopped is not None:
            cls, text, cause = self._stopped
            raise cls(describe(text, rank=self.rank, size=self.size, op=kind, tensor=tensor)) from cause

    def _cycle(self) -> None:
        t0 = time.perf_counter()
        self._cycle_no += 1
        tl = self._executor.timeline  # read once: a user thread may stop it meanwhile
        if self._mark_cycles and tl is not None:
            tl.mark("CYCLE_START", t0)
        if self._lane is not None:
            self._lane.sync()
        self._drain()
        if self.size == 1:
            return self._cycle_alone(t0)
        vec, payload = self._vector()
        self._comm.allreduce_flat(vec, vec, _INT32, _SUM, name="fusion.coordinate", control=True)
        self._cycle_rest(vec, payload, t0)

    def _cycle_rest(self, vec, payload: bytes, t0: float) -> None:
        """The cycle after the coordination allreduce: `vec` is the sum, `payload` this
        rank's announcements (the lane hands over a cycle it coordinated, here too)."""
        self._synced = time.perf_counter()
        res = self._layout.parse(vec)
        ready = [self._cache.at(bit) for bit in res.ready_bits]
        errors: list = []
        if res.negotiate or res.joined != self._last_joined:
            errors = self._negotiate(payload, res, ready)
            if self._lane is not None:
                self._lane.cache_changed()
        self._last_joined = res.joined
        t1 = time.perf_counter()
        self._metrics["cycles"] += 1
        self._metrics["coordination_s"] += t1 - t0
        self._execute([(sig, self._take(sig, t1)) for sig in ready], res.joined)
        if self._tuner is not None and self._tuner.active:
            self._tuner.cycle_done(ready)
            if not self._tuner.active:  # tuned: the lane runs again
                self._lane_update()
        for req, err in errors:
            self._done(req, None, err)
        self._after_join(res)
        if res.stall:
            self._stall.report(self._pending, res.joined, self._table, self._done)
        if res.shutdown:
            self._stop(CollectiveError, self._shutdown_text(res.shutdown), None)

    def _shutdown_text(self, ranks: tuple) -> str:
        others = [r for r in ranks if r != self.rank]
        if not others:
            return f"the fusion engine was shut down by rank(s) {list(ranks)}"
        who = f"rank {others[0]}" if len(others) == 1 else f"ranks {others}"
        return (f"{who} returned from the function (or called hvd.shutdown()) while this rank "
                "waits in this op; every rank must run the same number of steps, or use "
                "hvd.join()")

    def _execute(self, taken: list, joined: tuple) -> None:
        """Run the agreed ops; on a failure, what was taken but not finished goes back to
        the pending set, so the stop that follows fails its handles instead of leaving
        their callers waiting forever."""
        try:
            self._executor.run(taken, joined, self._cuda)
        except BaseException:
            for _, req in taken:
                if req is not None and not req.handle._done:
                    self._pending[req.name] = req
            raise

    def _cycle_alone(self, t0: float) -> None:
        """A world of one agrees with itself: everything pending is ready now."""
        ready = list(self._pending.values())
        self._pending = {}
        t1 = self._synced = time.perf_counter()
        self._metrics["cycles"] += 1
        self._metrics["coordination_s"] += t1 - t0
        for req in ready:
            req.t_ready = t1
        self._execute([(req.sig, req) for req in ready], (False,))  # all of them are ours
        if self._joined:
            self._after_join(C.CycleResult(False, (True,), (), (0,), [], False))
        if self._shutdown_requested:
            self._stop(CollectiveError, "the fusion engine was shut down by rank(s) [0]", None)

    def _drain(self) -> None:
        with self._lock:
            queue, self._queue = self._queue, []
        for item in queue:
            if isinstance(item, Handle):
                self._joined = True
                self._join_handles.append(item)
                self._lane_update()
            else:
                self._pending[item.name] = item

    def _vector(self):
        vec = self._layout.vector(self.rank, len(self._cache), stall=self._stall.due(self._pending),
                                  joined=self._joined, shutdown=self._shutdown_requested, announce=0)
        base, new = self._layout.bits, []
        for req in self._pending.values():
            bit = self._cache.bit(req.sig)
            if bit is not None:
                vec[base + bit] = C.DATA
                continue
            other = self._cache.by_name(req.name)
            if self._joined and other is not None:  # do not vouch for a signature we do not hold
                vec[base + self._cache.bit(other)] = 0
            if not req.announced:
                req.announced = True
                new.append(req.sig)
        payload = C.encode(new)
        vec[1 + 2 * self.size + self.rank] = len(payload)
        return vec, payload

    def _negotiate(self, payload: bytes, res: C.CycleResult, ready: List[Signature]) -> list:
        """Fold the announcements into the table; extends `ready`; returns local errors."""
        errors = []
        if res.negotiate:
            self._metrics["negotiations"] += 1
            for r, sigs in enumerate(C.gather_announcements(self._comm, payload, res.announce)):
                for sig in sigs:
                    self._cache.evict(sig.name)  # a new signature for a cached name replaces it
                    text = self._table.add(r, sig)
                    if text is not None and r == self.rank:
                        errors.append(self._mismatch(sig.name, text))
        agreed, mismatches = self._table.resolve(res.joined)
        for sig in agreed:
            self._cache.put(sig)
        ready.extend(agreed)
        for name, text, ranks in mismatches:
            if self.rank in ranks:
                errors.append(self._mismatch(name, text))
        return [e for e in errors if e[0] is not None]

    def _mismatch(self, name: str, text: str) -> tuple:
        req = self._pending.pop(name, None)
        kind = req.sig.kind if req is not None else None
        return req, MismatchError(describe(
            text, rank=self.rank, size=self.size, op=kind,
            hint="every rank must submit a name with one kind, dtype, shape, op and root"))

    def _take(self, sig: Signature, now: float) -> Optional[Request]:
        req = self._pending.get(sig.name)
        if req is not None and req.sig == sig:
            del self._pending[sig.name]
            req.t_ready = now
            return req
        if self._joined:
            return None
        raise AssertionError(describe(
            f"internal error: {sig.tensor()} was agreed ready but this rank holds "
            f"{req.sig.brief() if req else 'no request for it'}", rank=self.rank, size=self.size))

    def _done(self, req: Request, result, error: Optional[BaseException]) -> None:
        with self._lock:
            self._live.pop(req.name, None)
        self._metrics["tensors"] += 1
        req.handle._finish(result, error)

    def _after_join(self, res: C.CycleResult) -> None:
        for r in range(self.size):
            if res.joined[r]:
                self._join_first.setdefault(r, (self._cycle_no, r))
        if not all(res.joined):
            return
        last = max(self._join_first.values())[1]
        handles, self._join_handles = self._join_handles, []
        self._joined, self._join_first = False, {}
        self._lane_update()
        with self._lock:
            self._live_joins = [h for h in self._live_joins if h not in handles]
        for handle in handles:
            handle._finish(last)

    # -- stopping --------------------------------------------------------------
    def _stop(self, cls, text: str, cause: Optional[BaseException]) -> None:
        """Fail every op submitted and not finished, wherever the cycle left it (pending,
        queued, or taken by a cycle that an exception cut short)."""
        with self._lock:
            if self._stopped is None:
                self._stopped = (cls, text, cause)
            self._queue = []
            reqs, self._live = list(self._live.values()), {}
            joins, self._live_joins = self._live_joins, []
        self._lane_update()
        cls, text, cause = self._stopped
        self._pending, self._join_handles = {}, []
        for req in reqs:
            err = cls(describe(f"failed: {text}", rank=self.rank, size=self.size,
                               op=req.sig.kind, tensor=req.sig.tensor()))
            err.__cause__ = cause
            self._done(req, None, err)
        for handle in joins:
            err = cls(describe(f"failed: {text}", rank=self.rank, size=self.size, op="join"))
            err.__cause__ = cause
            handle._finish(None, err)
