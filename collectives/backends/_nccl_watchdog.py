"""A watchdog that turns a stuck or failed NCCL op into an error instead of a hang.

Terms: NCCL ops are *enqueued* on a CUDA stream and return at once; an op is
*pending* until a CUDA event recorded after it on that stream completes.  A
background thread polls every `poll` seconds: it drops completed ops, asks
NCCL for an asynchronous error (a peer's failure reaches us that way), and
fails when the oldest pending op is older than `timeout`.  To *fail* is to
record the error and abort the NCCL communicator, which makes the GPU
kernels of every pending op return, so nothing waits forever; the backend
raises the recorded error from its next op (torch's NCCL watchdog does the
same).

The age counts from enqueue, so GPU work queued before the op counts too;
the timeout is the Config's `timeout`, which is generous for one step.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Optional

__all__ = ["Watchdog"]


class Watchdog:
    """Args:
        check_async: raises the communicator's asynchronous NCCL error, if any.
        abort: aborts the communicator (called once, from the watchdog thread).
        on_timeout: (op, seq, tensor, age) -> the exception to record.
        on_async_error: exc -> the exception to record.
        done: event -> whether the GPU passed it; raises for an error on its stream (that
            error is recorded and the communicator aborted).  Default: event.done.
    """

    def __init__(self, timeout: float, check_async: Callable[[], None], abort: Callable[[], None],
                 on_timeout: Callable, on_async_error: Callable, poll: float = 0.05,
                 done: Optional[Callable] = None) -> None:
        self.timeout, self.poll = timeout, poll
        self._done = done or (lambda event: event.done)
        self._check_async, self._abort = check_async, abort
        self._on_timeout, self._on_async_error = on_timeout, on_async_error
        self._pending: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._loop, name="nccl-watchdog", daemon=True)
        self._thread.start()

    def track(self, event, op: str, seq: int, tensor: Optional[str]) -> None:
        """Watch `event` (recorded right after the op on its stream)."""
        with self._lock:
            self._pending.append((event, op, seq, tensor, time.monotonic()))

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def _loop(self) -> None:
        while not self._stop.wait(self.poll):
            if self.error is None:
                self._check_once()

    def _drop_done(self) -> None:
        """(under the lock) Ops on different streams may finish out of order: drop every done one."""
        self._pending = collections.deque(p for p in self._pending if not self._done(p[0]))

    def _check_once(self) -> None:
        try:
            with self._lock:
                self._drop_done()
                oldest = self._pending[0] if self._pending else None
        except Exception as exc:  # noqa: BLE001 - an error on an op's stream
            self._fail(exc)
            return
        if oldest is None:
            return
        try:
            self._check_async()
        except Exception as exc:  # noqa: BLE001 - NCCL's error becomes ours
            self._fail(self._on_async_error(exc))
            return
        event, op, seq, tensor, t0 = oldest
        age = time.monotonic() - t0
        if age > self.timeout:
            self._fail(self._on_timeout(op, seq, tensor, age))

    def _fail(self, err: BaseException) -> None:
        self.error = err
        try:
            self._abort()
        finally:
            with self._lock:
                self._pending.clear()

    def wait_idle(self, timeout: float) -> bool:
        """Block until nothing is pending (True), an error is recorded or `timeout` passes (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.error is not None:
                return False
            try:
                with self._lock:
                    self._drop_done()
                    if not self._pending:
                        return True
            except Exception as exc:  # noqa: BLE001 - an error on an op's stream
                self._fail(exc)
                return False
            time.sleep(min(self.poll, 0.005))
        return False

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
