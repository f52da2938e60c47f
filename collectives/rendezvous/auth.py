"""Mutual HMAC-SHA256 challenge-response on a freshly connected socket.

Both sides prove knowledge of the per-job secret before either parses a byte
of payload.  Every message of the handshake has a fixed length, so nothing
sent by an unauthenticated peer is ever interpreted beyond a byte compare.

    server -> client   MAGIC | server nonce (32)
    client -> server   MAGIC | client nonce (32) | HMAC(secret, "c" | context | sn | cn)
    server -> client   HMAC(secret, "s" | context | cn | sn)

Nonces are fresh per connection, so a recorded handshake cannot be replayed;
the context string ("store", "mesh", "log", ...) keeps a handshake for one
service from being accepted by another.

After it, both sides hold a *session key*, HMAC(secret, "k" | context | sn | cn),
and a `Channel` over it: every frame of the store and the log channel carries
a tag, HMAC(session key, direction | sequence number | frame), that the
receiver checks before it acts on the frame.  A frame injected on the path, a
changed one, a replayed or reordered one fails the check, and the connection
is dropped.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import socket
import threading
import time

from ..errors import AuthenticationError

__all__ = ["client_handshake", "server_handshake", "new_secret", "recv_exact", "Channel",
           "cut_short"]

MAGIC = b"HVS1"
NONCE = 32
MAC = 32


def new_secret() -> bytes:
    """32 random bytes: the per-job secret."""
    return os.urandom(32)


def _mac(secret: bytes, role: bytes, context: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(secret, role + context + b"|" + a + b, hashlib.sha256).digest()


class Channel:
    """The integrity of one authenticated connection's frames (see the module docstring)."""

    def __init__(self, key: bytes, sends: bytes, receives: bytes) -> None:
        self._key, self._sends, self._receives = key, sends, receives
        self._out = self._in = 0
        self._lock = threading.Lock()  # two threads may send on one connection (abort, lines)

    def seal(self, *parts: bytes) -> bytes:
        """The tag of the next frame this side sends, made of `parts`."""
        with self._lock:
            h = self._start(self._sends, self._out)
            self._out += 1
        for part in parts:
            h.update(part)
        return h.digest()

    def opening(self):
        """A running tag of the next frame received; feed it the frame's bytes, then `check`."""
        h = self._start(self._receives, self._in)
        self._in += 1
        return h

    def check(self, running, tag: bytes) -> None:
        if not hmac.compare_digest(running.digest(), tag):
            raise AuthenticationError("a frame failed its integrity check (changed, injected, "
                                      "replayed or reordered on the way): connection dropped")

    def open(self, tag: bytes, *parts: bytes) -> None:
        """Check a whole received frame made of `parts` against its tag."""
        h = self.opening()
        for part in parts:
            h.update(part)
        self.check(h, tag)

    def derive(self, label: bytes) -> bytes:
        """A key of this connection alone for `label` (the native mesh's frame tags:
        native/src/tcp/mac.h), never one of the frames' keys here."""
        return hmac.new(self._key, b"derive|" + label, hashlib.sha256).digest()

    def _start(self, role: bytes, seq: int):
        return hmac.new(self._key, role + seq.to_bytes(8, "big"), hashlib.sha256)


def _channel(secret: bytes, ctx: bytes, sn: bytes, cn: bytes, server: bool) -> Channel:
    key = hmac.new(secret, b"k" + ctx + b"|" + sn + cn, hashlib.sha256).digest()
    return Channel(key, b"S", b"C") if server else Channel(key, b"C", b"S")


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """Read exactly n bytes or raise ConnectionError (EOF) / socket.timeout."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout(f"timed out reading {n} bytes")
            sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _run(sock: socket.socket, timeout: float, steps) -> Channel:
    old = sock.gettimeout()
    deadline = time.monotonic() + timeout
    try:
        return steps(deadline)
    except (OSError, ConnectionError) as exc:
        raise AuthenticationError(f"handshake failed: {exc}") from exc
    finally:
        try:
            sock.settimeout(old)
        except OSError:
            pass


class _CutShort(AuthenticationError):
    """The connection ended before the server's hello: a busy server closed it unread."""


def cut_short(exc: AuthenticationError) -> bool:
    """Whether a handshake ended before the server said its hello (a busy server closes
    newcomers unread, `accept.AcceptGate`), not after the client's proof: worth another
    connection; a refused proof is not."""
    return isinstance(exc, _CutShort)


def server_handshake(sock: socket.socket, secret: bytes, context: str,
                     timeout: float = 10.0) -> Channel:
    """Authenticate the connecting peer; its frames' Channel, or AuthenticationError."""
    ctx = context.encode()

    def steps(deadline):
        sn = os.urandom(NONCE)
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        sock.sendall(MAGIC + sn)
        reply = recv_exact(sock, len(MAGIC) + NONCE + MAC, deadline)
        if reply[:4] != MAGIC:
            raise AuthenticationError("peer did not speak the handshake protocol")
        cn, mac = reply[4:4 + NONCE], reply[4 + NONCE:]
        if not hmac.compare_digest(mac, _mac(secret, b"c", ctx, sn, cn)):
            raise AuthenticationError("peer does not know the job secret")
        sock.sendall(_mac(secret, b"s", ctx, cn, sn))
        return _channel(secret, ctx, sn, cn, server=True)

    return _run(sock, timeout, steps)


def client_handshake(sock: socket.socket, secret: bytes, context: str,
                     timeout: float = 10.0) -> Channel:
    """Authenticate to a server, check that it knows the secret too; the frames' Channel."""
    ctx = context.encode()

    def steps(deadline):
        try:
            hello = recv_exact(sock, len(MAGIC) + NONCE, deadline)
        except ConnectionError as exc:  # (a timeout is no busy server's: it is not retried)
            raise _CutShort(f"handshake cut short before the server's hello: {exc}") from exc
        if hello[:4] != MAGIC:
            raise AuthenticationError("server did not speak the handshake protocol")
        sn = hello[4:]
        cn = os.urandom(NONCE)
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        sock.sendall(MAGIC + cn + _mac(secret, b"c", ctx, sn, cn))
        mac = recv_exact(sock, MAC, deadline)
        if not hmac.compare_digest(mac, _mac(secret, b"s", ctx, cn, sn)):
            raise AuthenticationError("server does not know the job secret")
        return _channel(secret, ctx, sn, cn, server=False)

    return _run(sock, timeout, steps)
