"""A rank's own channel: an AF_UNIX socketpair between its launcher and the rank process.

Terms.  The *launcher end* stays with the process that starts the rank (the local
launcher, a Spark task); the *rank end* is inherited by the rank process (HVS_CHANNEL
names its descriptor and the socket's inode, so a process that merely inherited the
variable cannot read some other descriptor), or handed to a zygote's child over
SCM_RIGHTS.  Nothing else holds an end: a socket cannot be reopened through
/proc/<pid>/fd, so what the launcher end receives is the rank's own word, and the job's
secret never appears in an environment or a command line.

Frames: a 1-byte kind, an 8-byte big-endian length, the body.

    launcher -> rank   S  the job secret, first
                       P  the payload (cloudpickle of fn, args, kwargs), where there is one
    rank -> launcher   M  the warm-start report (module names, comma-separated ASCII)
                       R  the encoded RankResult, last
"""
from __future__ import annotations

import os
import socket
import stat
import struct
import threading
import time
from typing import Optional

__all__ = ["LauncherEnd", "RankEnd", "CHANNEL_VAR"]

CHANNEL_VAR = "HVS_CHANNEL"
_HEAD = struct.Struct(">cQ")
#: Seconds the rank waits for the secret, which its launcher sends as it starts it.
SECRET_WAIT_S = 60.0
#: Seconds without a byte, after the rank process ended, before the launcher stops reading.
DRAIN_S = 1.0


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError(f"the channel closed {n - got} bytes before the end of a frame")
        got += k
    return bytes(buf)


def _send(sock: socket.socket, kind: bytes, body: bytes) -> None:
    head = _HEAD.pack(kind, len(body))
    if len(body) < 65536:
        sock.sendall(head + body)
    else:  # no copy of a large body
        sock.sendall(head)
        sock.sendall(body)


class LauncherEnd:
    """The launcher's end: sends the secret (and payload), keeps what the rank sends back.

    Make it before the rank process starts; pass `rank_fd` to it (`environ()` names it),
    then call `started()`, which closes this process's copy of the rank end and starts
    the thread that talks to the rank.
    """

    def __init__(self, secret: bytes, payload: Optional[bytes] = None) -> None:
        self._mine, self._theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._theirs.set_inheritable(True)
        self._hello = [(b"S", secret)] + ([(b"P", payload)] if payload is not None else [])
        self.result: Optional[bytes] = None
        self.modules: Optional[bytes] = None
        self._last = time.monotonic()
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def rank_fd(self) -> int:
        return self._theirs.fileno()

    def environ(self, fd: Optional[int] = None) -> dict:
        """The variable that tells the rank process where its end is (fd: its number there)."""
        ino = os.fstat(self._theirs.fileno()).st_ino
        return {CHANNEL_VAR: f"{self.rank_fd if fd is None else fd}:{ino}"}

    def started(self) -> None:
        self._theirs.close()
        self._thread = threading.Thread(target=self._talk, name="hvs-rank-channel", daemon=True)
        self._thread.start()

    def _talk(self) -> None:
        try:
            for kind, body in self._hello:
                _send(self._mine, kind, body)
        except OSError:  # the rank is gone already: read what it left
            pass
        try:
            while True:
                kind, n = _HEAD.unpack(_recv_exact(self._mine, _HEAD.size))
                body = _recv_exact(self._mine, n)
                self._last = time.monotonic()
                if kind == b"M":
                    self.modules = body
                elif kind == b"R":
                    self.result = body
                    return
        except (OSError, EOFError, struct.error):
            return
        finally:
            self._done.set()

    def finish(self) -> None:
        """After the rank process ended: wait while its last frames arrive, then close.
        (A descendant of the rank may hold its end open, so EOF alone is no signal.)"""
        while not self._done.wait(0.05):
            if self._thread is None or time.monotonic() - self._last > DRAIN_S:
                break
        self.close()

    def close(self) -> None:
        try:
            self._mine.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._mine.close()
        self._theirs.close()  # where the rank never started
        if self._thread is not None:
            self._thread.join(timeout=5.0)


class RankEnd:
    """The rank process's end, opened once per process from HVS_CHANNEL."""

    _own: dict = {}  # pid -> RankEnd: a process forked from a rank is not that rank

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lock = threading.Lock()
        self._secret: Optional[bytes] = None
        self._payload: Optional[bytes] = None

    @classmethod
    def of_this_process(cls, environ=None) -> Optional["RankEnd"]:
        """This rank's end, or None where the launcher gave it none; the variable leaves
        this process's environment, so the function's own subprocesses never see it."""
        own = cls._own.get(os.getpid())
        if own is not None:
            return own
        value = (os.environ if environ is None else environ).pop(CHANNEL_VAR, None)
        if value is None:
            return None
        try:
            fd, ino = (int(x) for x in value.split(":"))
            st = os.fstat(fd)
        except (ValueError, OSError):
            raise ValueError(f"{CHANNEL_VAR}={value!r} names no open descriptor of this process: "
                             "it belongs to the rank its launcher started, not to a process "
                             "that inherited its environment") from None
        if not stat.S_ISSOCK(st.st_mode) or st.st_ino != ino:
            raise ValueError(f"{CHANNEL_VAR}={value!r}: descriptor {fd} is not the rank's "
                             "channel (another process inherited the variable, not the socket)")
        sock = socket.socket(fileno=fd)
        sock.set_inheritable(False)  # the function's subprocesses never hold it
        cls._own[os.getpid()] = end = cls(sock)
        return end

    def _read(self, want: bytes) -> bytes:
        kind, n = _HEAD.unpack(_recv_exact(self._sock, _HEAD.size))
        if kind != want:
            raise ValueError(f"the launcher's channel sent frame {kind!r} where {want!r} was due")
        return _recv_exact(self._sock, n)

    def secret(self) -> bytes:
        """The job's secret, read once."""
        with self._lock:
            if self._secret is None:
                self._sock.settimeout(SECRET_WAIT_S)
                try:
                    self._secret = self._read(b"S")
                except (OSError, EOFError) as exc:
                    raise ValueError(f"the job's secret did not arrive from the launcher "
                                     f"({type(exc).__name__}: {exc})") from None
                finally:
                    self._sock.settimeout(None)
            return self._secret

    def payload(self) -> bytes:
        """The job's payload (after the secret): the function this rank runs."""
        self.secret()
        with self._lock:
            if self._payload is None:
                self._payload = self._read(b"P")
            return self._payload

    def report(self, modules: bytes) -> None:
        with self._lock:
            _send(self._sock, b"M", modules)

    def result(self, encoded: bytes) -> None:
        """The rank's RankResult, the last word on the channel."""
        with self._lock:
            _send(self._sock, b"R", encoded)
