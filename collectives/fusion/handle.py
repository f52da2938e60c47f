"""The handle of one named op: `wait(timeout)` returns its result or raises its error.

A handle is finished exactly once, by whoever runs the engine's cycle, with a
result or an error.  Waiting costs one lock acquire: the lock is held from
creation until the handle is finished, so `wait` blocks on it without
polling.  A first wait *kicks* the engine (`kick(handle, timeout)`): a caller
that waits has nothing more to submit, so the engine may run the cycle on the
caller's thread at once, or end its own thread's cycle-time sleep.
"""
from __future__ import annotations

import threading
from typing import Any, Optional

from ..errors import CollectiveTimeout, describe

__all__ = ["Handle"]


class Handle:
    __slots__ = ("name", "kind", "_rank", "_size", "_sig", "_kick", "_lock", "_done", "_result",
                 "_error", "lazy", "event")

    def __init__(self, name: str, kind: str, rank: int, size: int, sig=None, kick=None) -> None:
        self.name, self.kind = name, kind
        self._rank, self._size, self._sig, self._kick = rank, size, sig, kick
        self._lock = threading.Lock()
        self._lock.acquire()
        self._done = False
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self.lazy = False  # submitted lazily: its first waiter may run the engine's cycle
        self.event = None  # CUDA: (Done, fresh) of its cycle (`_streams`); each waiter's stream waits

    def poll(self) -> bool:
        """True once the op has finished (successfully or not); wait() then never blocks."""
        return self._done

    def wait(self, timeout: Optional[float] = None) -> Any:
        """The op's result.

        Raises:
            CollectiveTimeout: the op did not finish within `timeout` seconds (it keeps running).
            CollectiveError: the op failed on this rank, with the cause.
        """
        if not self._done:
            if self._kick is not None:
                self._kick(self, timeout)  # may run the cycle here and finish us
            if not self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
                raise CollectiveTimeout(describe(
                    "not finished", rank=self._rank, size=self._size, op=self.kind,
                    tensor=self._tensor(), timeout=timeout,
                    hint="another rank may not have submitted it yet (see the stall warnings)"))
            self._lock.release()
        if self._error is not None:
            raise self._error
        if self.event is not None:
            from ._streams import consume

            consume(self._result, *self.event)
        return self._result

    def _tensor(self) -> str:
        return self._sig.tensor() if self._sig is not None else f"'{self.name}'"

    def exception(self) -> Optional[BaseException]:
        return self._error if self._done else None

    def _finish(self, result: Any = None, error: Optional[BaseException] = None) -> None:
        if self._done:
            return
        try:
            self._result, self._error = result, error
            self._done = True
        finally:  # whatever interrupts us, the waiters are let go
            self._lock.release()

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else ("done" if self._done else "pending")
        return f"<Handle {self.kind} {self._tensor()} {state}>"
