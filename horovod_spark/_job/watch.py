"""The driver's watch over a running attempt: the whole-job timeout and the finish grace.

Spark's `collect()` waits for every task, so a rank that never returns (frozen
after its last collective, or running steps the others do not) would hold the
job for ever.  The watch ends the attempt with a record that names why: past
the job's `timeout`, or once a rank has returned (its task said `done` on the
log channel without a failure record) and the others have not within the
finish grace (see `collectives.launch.procs`).  It cancels the attempt's Spark
job and asks every task to kill its rank; the driver then raises the watch's
record instead of Spark's account of the cancel.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from collectives.launch.procs import unfinished_text
from collectives.launch.record import Failure

__all__ = ["Watch"]

_EVERY_S = 0.2


class Watch:
    def __init__(self, np_: int, server, cancel: Callable[[], None], timeout: Optional[float],
                 grace: float) -> None:
        """server: the attempt's LogServer or None (then only the timeout is watched)."""
        self._np, self._server, self._cancel = np_, server, cancel
        self._timeout, self._grace = timeout, grace
        self._t0 = time.monotonic()
        self._first_ok: Optional[tuple] = None
        self._stop = threading.Event()
        self.record: Optional[Failure] = None
        self._thread = threading.Thread(target=self._run, name="hvs-job-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)

    def _run(self) -> None:
        while not self._stop.wait(_EVERY_S):
            record = self._check(time.monotonic())
            if record is not None:
                self.record = record
                self._cancel()
                return

    def _check(self, now: float) -> Optional[Failure]:
        if self._timeout and now - self._t0 > self._timeout:
            running = self._running()
            return Failure(None, "JobTimeout", f"the job ran past its timeout of {self._timeout:g} s"
                           + (f"; ranks {running} still running" if running else ""),
                           size=self._np, hint="pass a larger timeout= (or None: no limit)")
        if self._server is None or self._grace <= 0:
            return None
        failed = {rec.get("rank") for rec in list(self._server.failures)}
        returned = sorted(set(self._server.done) - failed)
        if failed or not returned:
            return None
        if self._first_ok is None:
            self._first_ok = (now, returned[0])
        running = self._running()
        if running and now - self._first_ok[0] > self._grace:
            return Failure(running[0], "RankDidNotFinish",
                           unfinished_text(self._first_ok[1], running, self._grace), size=self._np)
        return None

    def _running(self) -> list:
        if self._server is None:
            return []
        return [r for r in range(self._np) if r not in self._server.done]
