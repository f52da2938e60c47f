"""Hostile clients for the security tests, the servers they attack, and a job under attack.

A hostile client speaks to any server that runs the `collectives.rendezvous.auth`
handshake: it skips the handshake, uses a wrong secret, replays a recorded
one, sends random bytes or a length no one should allocate, or connects and
says nothing.  A *service* is one of a job's servers, started here on
127.0.0.1 with a probe that proves it still serves a real client.
"""
from __future__ import annotations

import dataclasses
import io
import os
import pickle
import random
import socket
import struct
import threading
import time
from typing import Callable, Optional

from _fault_kit import FaultJob, notes, wait_until
from collectives.rendezvous import auth
from collectives.errors import AuthenticationError


def _connect(address: str, timeout: float = 5.0) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout)


def _send_and_hang_up(address: str, data: bytes, read_hello: bool = False) -> bytes:
    """Send data, half-close, and read until the server hangs up; returns what it sent."""
    with _connect(address) as s:
        got = b""
        try:
            if read_hello:
                got = auth.recv_exact(s, len(auth.MAGIC) + auth.NONCE, time.monotonic() + 5)
            if data:
                s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            while True:
                chunk = s.recv(4096)
                if not chunk:
                    return got
                got += chunk
        except (ConnectionError, OSError):  # a reset is a refusal too
            return got


def attack_without_secret(address: str, payload: bytes) -> bytes:
    """Skip the handshake and send a payload as if authenticated."""
    return _send_and_hang_up(address, payload)


def attack_with_wrong_secret(address: str, context: str) -> Optional[BaseException]:
    """A client that runs the handshake with the wrong secret; returns its error."""
    with _connect(address) as s:
        try:
            auth.client_handshake(s, os.urandom(32), context, timeout=5.0)
        except Exception as exc:  # the refusal under test
            return exc
    return None


def attack_with_secret(address: str, secret: bytes, context: str) -> Optional[BaseException]:
    """A client that runs the handshake with `secret` (one it stole); returns its error, or
    None where the server took it."""
    with _connect(address) as s:
        try:
            auth.client_handshake(s, secret, context, timeout=5.0)
        except Exception as exc:  # the refusal under test
            return exc
    return None


def recorded_handshake(address: str, secret: bytes, context: str) -> bytes:
    """What a real client sends in a successful handshake, captured on the wire."""
    sent = bytearray()
    with _connect(address) as s:
        real_sendall = s.sendall

        class Tap:
            def __getattr__(self, name):
                return getattr(s, name)

            def sendall(self, data):
                sent.extend(data)
                return real_sendall(data)

        auth.client_handshake(Tap(), secret, context, timeout=5.0)
    return bytes(sent)


def attack_replay(address: str, recorded: bytes) -> bytes:
    """Replay a recorded handshake on a new connection; returns what the server answered."""
    return _send_and_hang_up(address, recorded, read_hello=True)


def fuzz_strings(seed: int, n: int) -> list:
    """n random byte strings: empty, short, handshake-sized, and some behind a valid MAGIC."""
    rng = random.Random(seed)
    size = len(auth.MAGIC) + auth.NONCE + auth.MAC
    out = []
    for i in range(n):
        length = rng.choice([0, 1, 3, 4, 5, rng.randrange(0, 64), size, size,
                             rng.randrange(size, 600)])
        data = rng.randbytes(length)
        if i % 3 == 0:
            data = auth.MAGIC + data
        out.append(data)
    return out


def attack_fuzz(address: str, strings) -> int:
    """One connection per string; returns how many the server answered with more than its hello."""
    answered = 0
    hello = len(auth.MAGIC) + auth.NONCE
    for data in strings:
        answered += len(_send_and_hang_up(address, data)) > hello
    return answered


def oversized_header() -> bytes:
    """A handshake reply that is all length-like 0xff after the MAGIC."""
    return auth.MAGIC + b"\xff" * (auth.NONCE + auth.MAC) + struct.pack(">Q", 1 << 62)


class SilentClients:
    """n connections that connect and never send a byte, held open until close()."""

    def __init__(self, address: str, n: int) -> None:
        self.socks = [_connect(address) for _ in range(n)]

    def close(self) -> None:
        for s in self.socks:
            s.close()


class SilentServer:
    """A listener that accepts every connection and never answers."""

    def __init__(self, bind: str = "127.0.0.1") -> None:
        self._lst = socket.create_server((bind, 0))
        self.address = "%s:%d" % self._lst.getsockname()[:2]
        self._held: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self._held.append(self._lst.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        self._lst.close()
        for s in self._held:
            s.close()


# --------------------------------------------------------------------------- servers under attack

class Bomb:
    """A pickle that leaves a file behind if anyone ever unpickles it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@dataclasses.dataclass
class Service:
    name: str
    address: str
    context: str
    rejected: Callable[[], int]
    works: Callable[[], None]        # a real client's round trip; raises if the server broke
    unauthenticated: bytes           # a payload that would do harm if it were parsed
    planted: Callable[[], bool]      # did that payload reach the server?
    close: Callable[[], None]


def _store_frame(cmd: int, key: bytes, value: bytes) -> bytes:
    return bytes([cmd]) + struct.pack(">I", len(key)) + key + struct.pack(">Q", len(value)) + value


def _store_service(name, server, secret) -> Service:
    from collectives.rendezvous.store import TCPStore

    def works():
        client = TCPStore.connect(server.address, secret, timeout=10)
        try:
            client.set("job/probe", b"alive")
            assert client.get("job/probe", 5) == b"alive"
        finally:
            client.close()

    return Service(name, server.address, "store", lambda: server.rejected, works,
                   _store_frame(1, b"job/fn", pickle.dumps(Bomb("/nonexistent"))),
                   lambda: server.check("job/fn"), server.close)


def _log_service(secret) -> Service:
    from horovod_spark._job.logchannel import LineSink, LogClient, LogServer, send_frame

    out = io.StringIO()
    server = LogServer("127.0.0.1", secret, "job", LineSink(out, out), handshake_timeout=5.0)

    def works():
        client = LogClient(server.address, secret, "job", 7)
        client.line("stdout", "still serving")
        client.close()
        wait_until(lambda: "[7]<stdout>:still serving" in out.getvalue(), 10, "a line arrives")

    frames, sealed = socket.socketpair(), auth.Channel(os.urandom(32), b"C", b"S")
    send_frame(frames[0], {"t": "hello", "job": "job", "rank": 0}, sealed)
    send_frame(frames[0], {"t": "fail", "rec": {"rank": 0, "planted": True}}, sealed)
    frames[0].close()
    payload = frames[1].recv(65536)
    frames[1].close()
    return Service("log", server.address, "log", lambda: server.rejected, works, payload,
                   lambda: any(f.get("planted") for f in server.failures), server.close)


def make_service(name: str, secret: bytes) -> Service:
    """A server of a job, on 127.0.0.1: "store", "task-store" (Spark's) or "log"."""
    if name == "store":
        from collectives.rendezvous.store import TCPStore

        return _store_service(name, TCPStore.serve("127.0.0.1", secret), secret)
    if name == "task-store":
        from horovod_spark._job.spark_store import SparkStore

        return _store_service(name, SparkStore("127.0.0.1", secret, "job", 0, 1, lambda m: [m]),
                              secret)
    return _log_service(secret)


# --------------------------------------------------------------------------- a job under attack

def held_job(job: FaultJob, size: int, held, secret: bytes, connect_timeout: float = 20.0):
    """start_ranks of `_fault_ranks.held_bootstrap`; returns (group, launcher's store).

    The bootstrap deadline starts once every rank has published, so holding
    ranks does not eat into it.
    """
    import sys

    from collectives.launch import start_ranks

    code = f"import _fault_ranks as r; r.held_bootstrap({job.outdir!r}, {tuple(held)!r})"
    # every rank a host: the ranks hold TCP links, so rank 0 accepts while rank 1 is held
    return start_ranks([sys.executable, "-c", code], size,
                       job.env(tcp=True, connect_timeout=connect_timeout),
                       stdout=Discard(), stderr=Discard(), secret=secret)


class Discard:
    """An output stream that drops what rank processes print."""

    def write(self, text: str) -> None:
        pass

    def flush(self) -> None:
        pass


def rank0_listener(job: FaultJob, group, store) -> str:
    """host:port of rank 0's mesh listener, once rank 1 is held (rank 0 is accepting)."""
    import json

    key = f"{group.job}/fault/mesh/rank/0"
    info = json.loads(wait_until(lambda: store.check(key) and store.get(key), 60,
                                 "rank 0 publishes"))
    wait_until(lambda: notes(job.outdir, "listeners").get(1), 60, "rank 1 is held")
    return f"{info['addr']}:{info['port']}"


def finish_held(job: FaultJob, group):
    """Let held ranks go on; (their result notes, their exit codes)."""
    open(os.path.join(job.outdir, "go"), "w").close()
    wait_until(lambda: all(p.poll() is not None for p in group.procs), 60, "every rank exits")
    return notes(job.outdir, "result"), [p.returncode for p in group.procs]


def battery(address: str, context: str, secret: bytes, fuzz: int) -> dict:
    """Every attack on one server; the attacks that got anything past the server's hello."""
    hello = len(auth.MAGIC) + auth.NONCE
    got = {"no secret": len(attack_without_secret(address, SET_FN)) > hello,
           "wrong secret": not isinstance(attack_with_wrong_secret(address, context),
                                          AuthenticationError),
           "replay": len(attack_replay(address, recorded_handshake(address, secret,
                                                                   context))) > hello,
           "oversized header": len(attack_without_secret(address, oversized_header())) > hello,
           "random strings": attack_fuzz(address, fuzz_strings(seed=3, n=fuzz))}
    return {k: v for k, v in got.items() if v}


SET_FN = bytes([1]) + struct.pack(">I", 6) + b"job/fn" + struct.pack(">Q", 1) + b"x"
