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
"""
from __future__ import annotations

import hashlib
import hmac
import os
import socket
import time

from ..errors import AuthenticationError

__all__ = ["client_handshake", "server_handshake", "new_secret", "recv_exact"]

MAGIC = b"HVS1"
NONCE = 32
MAC = 32


def new_secret() -> bytes:
    """32 random bytes: the per-job secret."""
    return os.urandom(32)


def _mac(secret: bytes, role: bytes, context: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(secret, role + context + b"|" + a + b, hashlib.sha256).digest()


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


def _run(sock: socket.socket, timeout: float, steps) -> None:
    old = sock.gettimeout()
    deadline = time.monotonic() + timeout
    try:
        steps(deadline)
    except (OSError, ConnectionError) as exc:
        raise AuthenticationError(f"handshake failed: {exc}") from exc
    finally:
        try:
            sock.settimeout(old)
        except OSError:
            pass


def server_handshake(sock: socket.socket, secret: bytes, context: str, timeout: float = 10.0) -> None:
    """Authenticate the connecting peer; raise AuthenticationError if it fails."""
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

    _run(sock, timeout, steps)


def client_handshake(sock: socket.socket, secret: bytes, context: str, timeout: float = 10.0) -> None:
    """Authenticate to a server and check that the server knows the secret too."""
    ctx = context.encode()

    def steps(deadline):
        hello = recv_exact(sock, len(MAGIC) + NONCE, deadline)
        if hello[:4] != MAGIC:
            raise AuthenticationError("server did not speak the handshake protocol")
        sn = hello[4:]
        cn = os.urandom(NONCE)
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        sock.sendall(MAGIC + cn + _mac(secret, b"c", ctx, sn, cn))
        mac = recv_exact(sock, MAC, deadline)
        if not hmac.compare_digest(mac, _mac(secret, b"s", ctx, cn, sn)):
            raise AuthenticationError("server does not know the job secret")

    _run(sock, timeout, steps)
