"""A tiny key-value store for rendezvous, in the spirit of Gloo's and c10d's.

`InMemoryStore` serves threads of one process; `TCPStore` serves processes: a
server thread on the launcher (or the Spark task) and one client per rank.
Every TCP connection runs the mutual HMAC handshake of `_auth` before a byte
of payload is parsed.  Values are bytes, never pickles; what a caller puts in
them is its own business once the peer is authenticated.

Wire format after the handshake (all integers big-endian):

    request   cmd (1) | key length (u32) | key | value length (u64) | value | tag (32)
    reply     status (1) | value length (u64) | value | tag (32)

The tag is the connection's `auth.Channel` seal (session key, direction,
sequence number); a request whose tag fails is never acted on.

GET carries its timeout in milliseconds as the value; ADD carries an i64.  MGET (get many)
carries the timeout (i64 ms) then the keys, each a u32 length and its bytes, and waits
for all of them; its reply is each value, a u64 length and its bytes, in the keys' order:
one round trip for what would be one per key.

Closing a server ends every thread it started: the listener is shut down (on
Linux close() alone does not wake a blocked accept()), every connection is
shut down (waking a handler in recv or in the handshake), and waiters on a
key are woken, so a client sees its connection end rather than a silence.
"""
from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Iterable, Optional

from . import auth
from .accept import BACKLOG, AcceptGate, accept_loop
from ..errors import AuthenticationError, CollectiveError, CollectiveTimeout, PeerLostError, describe

__all__ = ["Store", "InMemoryStore", "ForeignStore", "TCPStore", "StoreServer"]

_SET, _GET, _ADD, _DEL, _CHECK, _MGET = 1, 2, 3, 4, 5, 6
_OK, _TIMEOUT, _ERROR = 0, 1, 2
MAX_KEY = 4096
MAX_VALUE = 1 << 31
JOIN_TIMEOUT = 5.0  # how long close() waits for the server's threads to end
_NAMES = {_SET: "set", _GET: "get", _ADD: "add", _DEL: "delete", _CHECK: "check",
          _MGET: "get_many"}


class Store:
    """set / get (waits) / wait / add / delete on byte values."""

    def set(self, key: str, value: bytes) -> None:
        raise NotImplementedError

    def get(self, key: str, timeout: Optional[float] = None) -> bytes:
        raise NotImplementedError

    def add(self, key: str, amount: int) -> int:
        raise NotImplementedError

    def delete(self, key: str) -> None:
        raise NotImplementedError

    def check(self, key: str) -> bool:
        raise NotImplementedError

    def wait(self, keys: Iterable[str], timeout: Optional[float] = None) -> None:
        self.get_many(keys, timeout)

    def get_many(self, keys: Iterable[str], timeout: Optional[float] = None) -> list:
        """The values of `keys`, in order, waiting for each (one deadline for all)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        out = []
        for key in keys:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            out.append(self.get(key, left))
        return out

    def close(self) -> None:
        pass


class ForeignStore(Store):
    """Another framework's key-value store seen as a `Store`: anything with set(key, value),
    get(key) that waits, add(key, n), check([keys]) and delete_key(key), as torch's c10d
    stores have.  Its get waits with the foreign store's own timeout; `get`'s here is kept by
    polling `check`."""

    def __init__(self, store, poll: float = 0.01) -> None:
        self._store, self._poll = store, poll

    def set(self, key, value):
        self._store.set(key, bytes(value))

    def get(self, key, timeout=None):
        if timeout is not None:
            deadline = time.monotonic() + timeout
            while not self.check(key):
                if time.monotonic() > deadline:
                    raise CollectiveTimeout(f"store key {key!r} not set after {timeout:g} s")
                time.sleep(self._poll)
        return bytes(self._store.get(key))

    def add(self, key, amount):
        return int(self._store.add(key, int(amount)))

    def delete(self, key):
        self._store.delete_key(key)

    def check(self, key):
        return bool(self._store.check([key]))


class InMemoryStore(Store):
    def __init__(self) -> None:
        self._data: dict = {}
        self._cond = threading.Condition()
        self._closed = False

    def set(self, key, value):
        with self._cond:
            self._data[key] = bytes(value)
            self._cond.notify_all()

    def get(self, key, timeout=None):
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._data or self._closed, timeout):
                raise CollectiveTimeout(f"store: key {key!r} not set after {timeout:g} s")
            if key not in self._data:
                raise CollectiveError(f"store: closed while waiting for key {key!r}")
            return self._data[key]

    def add(self, key, amount):
        with self._cond:
            val = int(self._data.get(key, b"0")) + int(amount)
            self._data[key] = str(val).encode()
            self._cond.notify_all()
            return val

    def delete(self, key):
        with self._cond:
            self._data.pop(key, None)

    def check(self, key):
        with self._cond:
            return key in self._data

    def close(self) -> None:
        """Wake every get() still waiting; they raise CollectiveError."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def _unpack_keys(body: bytes) -> list:
    keys, at = [], 0
    while at < len(body):
        n = struct.unpack(">I", body[at:at + 4])[0]
        if n > MAX_KEY:
            raise ValueError("key too long")
        keys.append(body[at + 4:at + 4 + n].decode())
        at += 4 + n
    return keys


def _send_frame(sock, channel: auth.Channel, head: bytes, key: bytes, value: bytes) -> None:
    """One request: head, key and value with their lengths, then the frame's tag."""
    front = head + struct.pack(">I", len(key)) + key + struct.pack(">Q", len(value))
    tag = channel.seal(front, value)
    sock.sendall(front)
    if value:
        sock.sendall(value)
    sock.sendall(tag)


class StoreServer(InMemoryStore):
    """The store itself, plus a thread that serves it over authenticated TCP."""

    def __init__(self, bind: str, port: int, secret: bytes) -> None:
        super().__init__()
        self._secret = secret
        self._listener = socket.create_server((bind, port), backlog=BACKLOG)
        self.address = "%s:%d" % self._listener.getsockname()[:2]
        self.rejected = 0  # connections dropped for failing the handshake
        #: what it served: connections (accepted, and most at once), requests, bytes in and out
        #: (frames after the handshake), for benchmarks/scale.py
        self.stats = {"connections": 0, "peak_connections": 0, "requests": 0, "bytes_in": 0,
                      "bytes_out": 0}
        self._conns: set = set()
        self._threads: set = set()
        self._lock = threading.Lock()
        self._gate = AcceptGate()
        self._spawn(self._accept_loop, "store-accept")

    def _spawn(self, target, name: str, *args) -> None:
        thread = threading.Thread(target=self._run, args=(target, args), daemon=True,
                                  name=f"{name} {self.address}")
        with self._lock:
            self._threads.add(thread)
        thread.start()

    def _run(self, target, args) -> None:
        try:
            target(*args)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _accept_loop(self) -> None:
        accept_loop(self._listener, lambda: self._closed, self._gate, self._admitted)

    def _admitted(self, conn: socket.socket) -> None:
        with self._lock:
            if self._closed:
                conn.close()
                self._gate.release(conn)
                return
            self._conns.add(conn)
            self.stats["connections"] += 1
            self.stats["peak_connections"] = max(self.stats["peak_connections"], len(self._conns))
        self._spawn(self._serve, "store-conn", conn)

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                self._serve_authenticated(conn)
        finally:
            with self._lock:
                self._conns.discard(conn)

    def _serve_authenticated(self, conn: socket.socket) -> None:
        try:
            channel = auth.server_handshake(conn, self._secret, "store")
        except AuthenticationError:
            if not self._closed:  # a handshake cut short by close() is no attack
                self.rejected += 1
            return
        finally:
            self._gate.release(conn)
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while not self._closed and self._handle(conn, channel):
                pass
        except AuthenticationError:  # a frame that failed its tag: nothing of it was done
            if not self._closed:
                self.rejected += 1
        except (OSError, ConnectionError, ValueError):
            return

    def _handle(self, conn, channel: auth.Channel) -> bool:
        try:
            head = auth.recv_exact(conn, 5)
        except ConnectionError:
            return False
        cmd, klen = head[0], struct.unpack(">I", head[1:])[0]
        if klen > MAX_KEY:
            raise ValueError("key too long")
        raw_key = auth.recv_exact(conn, klen)
        vlen_bytes = auth.recv_exact(conn, 8)
        vlen = struct.unpack(">Q", vlen_bytes)[0]
        if vlen > MAX_VALUE:
            raise ValueError("value too long")
        value = auth.recv_exact(conn, vlen) if vlen else b""
        channel.open(auth.recv_exact(conn, auth.MAC), head + raw_key + vlen_bytes, value)
        status, out = self._dispatch(cmd, raw_key.decode(), value)
        front = bytes([status]) + struct.pack(">Q", len(out))
        conn.sendall(front + out + channel.seal(front, out))
        with self._lock:
            self.stats["requests"] += 1
            self.stats["bytes_in"] += 13 + klen + vlen + auth.MAC
            self.stats["bytes_out"] += len(front) + len(out) + auth.MAC
        return True

    def _dispatch(self, cmd, key, value):
        try:
            if cmd == _SET:
                self.set(key, value)
                return _OK, b""
            if cmd == _GET:
                ms = struct.unpack(">q", value)[0]
                return _OK, self.get(key, None if ms < 0 else ms / 1000.0)
            if cmd == _ADD:
                return _OK, struct.pack(">q", self.add(key, struct.unpack(">q", value)[0]))
            if cmd == _DEL:
                self.delete(key)
                return _OK, b""
            if cmd == _CHECK:
                return _OK, b"1" if self.check(key) else b"0"
            if cmd == _MGET:
                ms = struct.unpack(">q", value[:8])[0]
                values = self.get_many(_unpack_keys(value[8:]), None if ms < 0 else ms / 1000.0)
                return _OK, b"".join(struct.pack(">Q", len(v)) + v for v in values)
        except CollectiveTimeout as exc:
            return _TIMEOUT, str(exc).encode()
        except Exception as exc:  # reported to the client, never crashes the server
            return _ERROR, f"{type(exc).__name__}: {exc}".encode()
        return _ERROR, f"unknown store command {cmd}".encode()

    def close(self) -> None:
        """Stop serving and end every thread of this server (see the module docstring)."""
        super().close()  # sets _closed and wakes waiting gets
        with self._lock:
            conns, threads = list(self._conns), list(self._threads)
        for sock in [self._listener] + conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        try:
            self._listener.close()
        except OSError:
            pass
        deadline = time.monotonic() + JOIN_TIMEOUT
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(deadline - time.monotonic(), 0.0))


class TCPStore(Store):
    """Client of a StoreServer.  Thread-safe: one request at a time per client."""

    def __init__(self, sock: socket.socket, address: str, channel: auth.Channel) -> None:
        self._sock, self.address, self._channel = sock, address, channel
        self._lock = threading.Lock()

    @staticmethod
    def serve(bind: str = "127.0.0.1", secret: bytes = b"", port: int = 0) -> StoreServer:
        if not secret:
            raise ValueError("TCPStore.serve needs the job secret (32 random bytes)")
        return StoreServer(bind, port, secret)

    @classmethod
    def connect(cls, address: str, secret: bytes, timeout: float = 60.0,
                listening: bool = False) -> "TCPStore":
        """A client of the store at `address`, retried until `timeout` while it refuses (not
        up yet); `listening`: the store is known to have been listening, so a refusal means
        it is gone, at once."""
        host, port = address.rsplit(":", 1)
        deadline = time.monotonic() + timeout
        while True:
            try:
                sock = socket.create_connection((host, int(port)), timeout=max(deadline - time.monotonic(), 0.1))
            except OSError as exc:
                if time.monotonic() > deadline or (
                        listening and isinstance(exc, ConnectionRefusedError)):
                    raise PeerLostError(f"cannot reach the rendezvous store at {address}: {exc}") from exc
                time.sleep(0.05)
                continue
            try:
                channel = auth.client_handshake(sock, secret, "store",
                                                timeout=max(deadline - time.monotonic(), 1.0))
                break
            except AuthenticationError as exc:  # cut short (a busy server evicted it): again
                sock.close()
                if not auth.cut_short(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(sock, address, channel)

    def _call(self, cmd: int, key: str, value: bytes = b"") -> bytes:
        with self._lock:
            try:
                _send_frame(self._sock, self._channel, bytes([cmd]), key.encode(), value)
                front = auth.recv_exact(self._sock, 9)
                status, n = front[0], struct.unpack(">Q", front[1:])[0]
                out = auth.recv_exact(self._sock, n) if n else b""
                self._channel.open(auth.recv_exact(self._sock, auth.MAC), front, out)
            except (OSError, ConnectionError) as exc:
                raise PeerLostError(describe(
                    f"lost the rendezvous store: {exc}", op=f"store {_NAMES[cmd]} {key!r}",
                    address=self.address,
                    hint="was the store closed, or did the process serving it exit?")) from exc
        if status == _TIMEOUT:
            raise CollectiveTimeout(out.decode())
        if status != _OK:
            raise CollectiveError(f"store at {self.address}: {out.decode()}")
        return out

    def set(self, key, value):
        self._call(_SET, key, bytes(value))

    def get(self, key, timeout=None):
        ms = -1 if timeout is None else int(timeout * 1000)
        return self._call(_GET, key, struct.pack(">q", ms))

    def add(self, key, amount):
        return struct.unpack(">q", self._call(_ADD, key, struct.pack(">q", int(amount))))[0]

    def delete(self, key):
        self._call(_DEL, key)

    def check(self, key):
        return self._call(_CHECK, key) == b"1"

    def get_many(self, keys, timeout=None):
        keys = list(keys)
        ms = -1 if timeout is None else int(timeout * 1000)
        body = struct.pack(">q", ms) + b"".join(struct.pack(">I", len(k.encode())) + k.encode()
                                                for k in keys)
        out = self._call(_MGET, keys[0] if keys else "", body)
        values, at = [], 0
        while at < len(out):
            n = struct.unpack(">Q", out[at:at + 8])[0]
            values.append(out[at + 8:at + 8 + n])
            at += 8 + n
        return values

    def close(self):
        """Close the connection; a request blocked on it in another thread fails at once."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # close() alone would not wake its recv
        except OSError:
            pass
        try:
            self._sock.close()
        except OSError:
            pass
