"""The accept loop of every authenticated server (the store, the driver's log server).

Terms.  A *pending* connection is one accepted whose handshake has not ended;
each costs a thread and a descriptor for up to the handshake timeout, so at
most MAX_PENDING are held.  Past the cap, the oldest is evicted (shut down at
once) where it has been pending for MIN_AGE_S, else the new one is closed at
once; a client whose handshake is cut short that way tries again (the store's
and the log channel's clients do, within their timeout).  A flood of silent
connections then cannot starve the server of descriptors or threads, nor keep a
real client out for long (a flood's connections age and are evicted; a real
handshake takes milliseconds), and a burst of real clients (a thousand tasks at
a job's start, on a loaded driver) is served in turn, never evicted mid-handshake.  A *transient*
accept error (no descriptor left: EMFILE, ENFILE; no buffer or memory; a
connection aborted before it was taken) is waited out with a back-off of 10 ms
doubling to 1 s, never a reason to stop serving; any other error ends the loop,
as closing the listener does.
"""
from __future__ import annotations

import collections
import errno
import socket
import threading
import time
from typing import Callable

__all__ = ["AcceptGate", "accept_loop", "MAX_PENDING", "MIN_AGE_S", "BACKLOG"]

MAX_PENDING = 64
#: Seconds a pending connection is kept, however many come after it.
MIN_AGE_S = 1.0
#: The listen backlog of the servers that use the gate (the kernel caps it at somaxconn).
BACKLOG = 4096
_TRANSIENT = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED,
              errno.EPROTO, errno.EINTR, errno.EAGAIN, errno.EPERM}
_BACKOFF_S = (0.01, 1.0)


class AcceptGate:
    """The pending connections, oldest first; `admit` evicts the oldest past the cap."""

    def __init__(self, max_pending: int = MAX_PENDING, min_age: float = MIN_AGE_S) -> None:
        self._max, self._min_age = max_pending, min_age
        self._cond = threading.Condition()
        self._pending: "collections.OrderedDict[socket.socket, float]" = collections.OrderedDict()
        self.evicted = 0  # connections shut down for want of a pending slot

    def admit(self, conn: socket.socket) -> bool:
        """Hold `conn` as pending, evicting the oldest past the cap where it is MIN_AGE_S old;
        False where none is (`conn` is closed then: its client tries again)."""
        evict = None
        with self._cond:
            if len(self._pending) >= self._max:
                oldest, since = next(iter(self._pending.items()))
                if time.monotonic() - since < self._min_age:
                    self.evicted += 1
                    evict, conn = conn, None
                else:
                    del self._pending[oldest]
                    evict = oldest
                    self.evicted += 1
            if conn is not None:
                self._pending[conn] = time.monotonic()
        if evict is not None:
            try:  # wakes its handshake, which fails and ends the connection's thread
                evict.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            if conn is None:
                evict.close()
        return conn is not None

    def release(self, conn: socket.socket) -> None:
        """The handshake of `conn` ended (either way)."""
        with self._cond:
            if self._pending.pop(conn, None) is not None:
                self._cond.notify()


def accept_loop(listener: socket.socket, closed: Callable[[], bool], gate: AcceptGate,
                on_conn: Callable[[socket.socket], None]) -> None:
    """Accept until `closed()` or a lasting error; hand each connection to `on_conn`, which
    must call `gate.release(conn)` once its handshake has ended."""
    delay = 0.0
    while not closed():
        try:
            conn, _ = listener.accept()
        except OSError as exc:
            if closed() or exc.errno not in _TRANSIENT:
                return
            delay = min(max(delay * 2, _BACKOFF_S[0]), _BACKOFF_S[1])
            time.sleep(delay)
            continue
        delay = 0.0
        if gate.admit(conn):
            on_conn(conn)
