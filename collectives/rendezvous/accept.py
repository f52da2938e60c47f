"""The accept loop of every authenticated server (the store, the driver's log server).

Terms.  A *pending* connection is one accepted whose handshake has not ended;
each costs a thread and a descriptor for up to the handshake timeout, so at
most MAX_PENDING are held: a new one past the cap evicts the oldest (shut
down at once).  A flood of silent connections then cannot starve the server
of descriptors or threads, nor keep a real client out: its handshake takes
milliseconds, a flood's connections wait to be evicted.  A *transient*
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

__all__ = ["AcceptGate", "accept_loop", "MAX_PENDING"]

MAX_PENDING = 64
_TRANSIENT = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED,
              errno.EPROTO, errno.EINTR, errno.EAGAIN, errno.EPERM}
_BACKOFF_S = (0.01, 1.0)


class AcceptGate:
    """The pending connections, oldest first; `admit` evicts the oldest past the cap."""

    def __init__(self, max_pending: int = MAX_PENDING) -> None:
        self._max, self._lock = max_pending, threading.Lock()
        self._pending: "collections.OrderedDict[socket.socket, None]" = collections.OrderedDict()
        self.evicted = 0  # connections shut down for want of a pending slot

    def admit(self, conn: socket.socket) -> None:
        evict = None
        with self._lock:
            if len(self._pending) >= self._max:
                evict, _ = self._pending.popitem(last=False)
                self.evicted += 1
            self._pending[conn] = None
        if evict is not None:
            try:  # wakes its handshake, which fails and ends the connection's thread
                evict.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def release(self, conn: socket.socket) -> None:
        """The handshake of `conn` ended (either way)."""
        with self._lock:
            self._pending.pop(conn, None)


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
        gate.admit(conn)
        on_conn(conn)
