"""How the "hvs" backend runs its ops: a queue per group, and the c10d Works it returns.

Terms.  An *op* is one submitted collective, a function and the torch Future its result
completes.  The *queue* holds a group's ops in submission order; whoever takes an op first
runs it: the group's thread (so an op nobody waits for, such as DDP's bucket allreduce, runs
while backward goes on) or the caller's own thread when it waits for an op not yet begun (a
blocking call pays no thread hop).  One op runs at a time, oldest first.  A *Work* is the
c10d face of an op: wait() raises the op's error (torch's own from-a-future Work swallows
it); a *done Work* is one of an op that has run, its future made only when asked for.
"""
from __future__ import annotations

import collections
import threading
from typing import Optional

import torch._C._distributed_c10d as c10d
from torch.futures import Future

__all__ = ["Queue", "Work", "Done"]


class _Op:
    """One submitted op: `fn` to run, and the torch Future its result completes."""

    __slots__ = ("fn", "fut", "done")

    def __init__(self, fn) -> None:
        self.fn, self.fut, self.done = fn, Future(), False

    def run(self) -> None:
        try:
            value = self.fn()
        except BaseException as exc:  # noqa: BLE001 (the future carries it to every waiter)
            self.done = True
            self.fut.set_exception(exc)
        else:
            self.done = True
            self.fut.set_result(value)


class Queue:
    """A group's ops in submission order, each run by whoever takes it first: the group's
    thread (so an op a caller does not wait for, such as DDP's bucket allreduce, runs while
    backward goes on), or the caller's own thread when it waits for an op not yet begun
    (a blocking call pays no thread hop).  One op runs at a time, oldest first."""

    def __init__(self) -> None:
        self._ops: collections.deque = collections.deque()
        self._running = threading.Lock()  # held while an op runs: one at a time, in order
        self._wake = threading.Condition(threading.Lock())
        self._thread: Optional[threading.Thread] = None
        self._stopping = False

    def submit(self, fn) -> "Work":
        op = _Op(fn)
        with self._wake:
            if self._stopping:
                raise RuntimeError("hvs: the process group was shut down")
            self._ops.append(op)
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="hvs-c10d", daemon=True)
                self._thread.start()
            self._wake.notify()
        return Work(op, self)

    def run_now(self, fn) -> "Done":
        """An op its caller waits for at once (torch's blocking calls: `opts.asyncOp` off):
        run here after the ops before it, with no thread hop and no wake of the thread; its
        error raises here."""
        with self._running:
            while self._ops:
                nxt = self._take()
                if nxt is not None:
                    nxt.run()
            return Done(fn())

    def _take(self) -> Optional[_Op]:
        with self._wake:
            return self._ops.popleft() if self._ops else None

    def run_through(self, op: _Op) -> None:
        """Run the queue's ops on this thread until `op` has run (or another thread ran it)."""
        with self._running:
            while not op.done:
                nxt = self._take()
                if nxt is None:
                    return  # taken by the group's thread: it has run, under this lock
                nxt.run()

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not self._ops and not self._stopping:
                    self._wake.wait()
                if self._stopping and not self._ops:
                    return
            with self._running:
                op = self._take()
                if op is not None:
                    op.run()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()


class Work(c10d.Work):
    """A c10d Work over a submitted op.  wait() runs the op on the caller's thread if no
    thread has begun it, and raises its error (torch's own from-a-future Work swallows it)."""

    def __init__(self, op: _Op, queue: Queue) -> None:
        super().__init__()
        self._op, self._queue = op, queue

    def wait(self, timeout=None) -> bool:
        if not self._op.done:
            self._queue.run_through(self._op)
        self._op.fut.wait()
        return True

    def is_completed(self) -> bool:
        return self._op.done

    def get_future(self) -> Future:
        return self._op.fut


class Done(c10d.Work):
    """The Work of an op that has run: its future, made when asked for, holds `value`."""

    def __init__(self, value) -> None:
        super().__init__()
        self._value = value

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> Future:
        fut = Future()
        fut.set_result(self._value)
        return fut
