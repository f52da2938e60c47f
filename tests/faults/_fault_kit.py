"""The test side of the fault suite: run a job that is meant to fail, then look for leftovers.

Terms.  A job's rank processes carry a *tag* (HVS_FAULT_TAG in their
environment), so psutil can count the ones still alive after the driver
raised, on whatever executor they run.  An *outcome* is what a run left: the
exception the driver raised and when, the value if none, the notes the ranks
wrote (see `_fault_ranks`) and the rank output.  *Detection time* is the
driver's raise minus the victim's `killed` note: both are `time.time()` on one
machine.  Shared-memory segments of the native backend are named
`/dev/shm/hvs-<pid of the creating rank>-<random>`, so the segments a job
leaked are found from its ranks' pids.

Also here: the hostile clients of the security tests (`attack_*`), which
speak to any server that runs the `_auth` handshake.
"""
from __future__ import annotations

import dataclasses
import glob
import io
import json
import os
import pickle
import random
import socket
import struct
import threading
import time
import uuid
from typing import Any, Callable, Dict, Optional

import psutil

from collectives import _auth

TAG_VAR = "HVS_FAULT_TAG"


def new_tag() -> str:
    return uuid.uuid4().hex[:12]


# --------------------------------------------------------------------------- waiting

def wait_until(predicate: Callable[[], Any], timeout: float, what: str, every: float = 0.02):
    """predicate()'s first truthy value; AssertionError naming `what` after `timeout` s."""
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not true after {timeout:g} s")
        time.sleep(every)


# --------------------------------------------------------------------------- notes

def notes(outdir, what: str) -> Dict[int, dict]:
    out = {}
    for path in glob.glob(os.path.join(str(outdir), f"{what}.*.json")):
        rank = int(os.path.basename(path).split(".")[1])
        with open(path) as f:
            out[rank] = json.load(f)
    return out


@dataclasses.dataclass
class Outcome:
    error: Optional[BaseException]
    value: Any
    started_at: float
    raised_at: float
    outdir: str
    output: str

    def notes(self, what: str) -> Dict[int, dict]:
        return notes(self.outdir, what)

    @property
    def killed_at(self) -> Optional[float]:
        killed = self.notes("killed")
        return min(n["t"] for n in killed.values()) if killed else None

    @property
    def detect_s(self) -> Optional[float]:
        """Seconds from the fault to the driver's exception."""
        return None if self.killed_at is None else self.raised_at - self.killed_at

    def pids(self) -> list:
        return [n["pid"] for n in self.notes("pid").values()]


def run_job(launch: Callable[[io.StringIO], Any], outdir) -> Outcome:
    """launch(sink) runs a job with its output going to sink; keep what happened."""
    sink = io.StringIO()
    t0 = time.time()
    try:
        value, error = launch(sink), None
    except Exception as exc:  # the driver's failure is the result under test
        value, error = None, exc
    return Outcome(error, value, t0, time.time(), str(outdir), sink.getvalue())


def run_local_job(fn, np_: int, args=(), env=None, outdir=".", timeout: float = 90.0) -> Outcome:
    from collectives.launch import run_local

    return run_job(lambda sink: run_local(fn, np_, args=args, env=env, stdout=sink, stderr=sink,
                                          timeout=timeout), outdir)


def run_spark_job(fn, np_: int, args=(), env=None, outdir=".", **kw) -> Outcome:
    import horovod_spark

    return run_job(lambda sink: horovod_spark.run(fn, args=args, num_proc=np_, env=env,
                                                  stdout=sink, stderr=sink, verbose=0, **kw), outdir)


# --------------------------------------------------------------------------- leftovers

def tagged(tag: str) -> list:
    """Live (not zombie) processes whose environment carries the tag."""
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get(TAG_VAR) == tag:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def wait_gone(tag: str, timeout: float = 10.0) -> tuple:
    """(seconds until no tagged process was left, processes still left at the timeout)."""
    t0 = time.monotonic()
    while True:
        left = tagged(tag)
        if not left or time.monotonic() - t0 > timeout:
            return time.monotonic() - t0, left
        time.sleep(0.05)


def kill_tagged(tag: str) -> None:
    """SIGKILL what a failed test left (processes this suite started, found by their tag)."""
    for p in tagged(tag):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def shm_segments(pids) -> list:
    """/dev/shm segments created by any of these rank pids."""
    return sorted(os.path.basename(p) for pid in pids for p in glob.glob(f"/dev/shm/hvs-{pid}-*"))


def remove_segments(names) -> None:
    for name in names:
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except FileNotFoundError:
            pass


def rss() -> int:
    return psutil.Process().memory_info().rss


# --------------------------------------------------------------------------- hostile clients

def _connect(address: str, timeout: float = 5.0) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout)


def _send_and_hang_up(address: str, data: bytes, read_hello: bool = False) -> bytes:
    """Send data, half-close, and read until the server hangs up; returns what it sent."""
    with _connect(address) as s:
        got = b""
        try:
            if read_hello:
                got = _auth.recv_exact(s, len(_auth.MAGIC) + _auth.NONCE, time.monotonic() + 5)
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
            _auth.client_handshake(s, os.urandom(32), context, timeout=5.0)
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

        _auth.client_handshake(Tap(), secret, context, timeout=5.0)
    return bytes(sent)


def attack_replay(address: str, recorded: bytes) -> bytes:
    """Replay a recorded handshake on a new connection; returns what the server answered."""
    return _send_and_hang_up(address, recorded, read_hello=True)


def fuzz_strings(seed: int, n: int) -> list:
    """n random byte strings: empty, short, handshake-sized, and some behind a valid MAGIC."""
    rng = random.Random(seed)
    size = len(_auth.MAGIC) + _auth.NONCE + _auth.MAC
    out = []
    for i in range(n):
        length = rng.choice([0, 1, 3, 4, 5, rng.randrange(0, 64), size, size, rng.randrange(size, 600)])
        data = rng.randbytes(length)
        if i % 3 == 0:
            data = _auth.MAGIC + data
        out.append(data)
    return out


def attack_fuzz(address: str, strings) -> int:
    """One connection per string; returns how many the server answered with more than its hello."""
    answered = 0
    hello = len(_auth.MAGIC) + _auth.NONCE
    for data in strings:
        answered += len(_send_and_hang_up(address, data)) > hello
    return answered


def oversized_header() -> bytes:
    """A handshake reply that is all length-like 0xff after the MAGIC."""
    return _auth.MAGIC + b"\xff" * (_auth.NONCE + _auth.MAC) + struct.pack(">Q", 1 << 62)


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
    from collectives.store import TCPStore

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
    from horovod_spark._output import LineSink, LogClient, LogServer, send_frame

    out = io.StringIO()
    server = LogServer("127.0.0.1", secret, "job", LineSink(out, out), handshake_timeout=5.0)

    def works():
        client = LogClient(server.address, secret, "job", 7)
        client.line("stdout", "still serving")
        client.close()
        wait_until(lambda: "[7]<stdout>:still serving" in out.getvalue(), 10, "a line arrives")

    frames = socket.socketpair()
    send_frame(frames[0], {"t": "hello", "job": "job", "rank": 0})
    send_frame(frames[0], {"t": "fail", "rec": {"rank": 0, "planted": True}})
    frames[0].close()
    payload = frames[1].recv(65536)
    frames[1].close()
    return Service("log", server.address, "log", lambda: server.rejected, works, payload,
                   lambda: any(f.get("planted") for f in server.failures), server.close)


def make_service(name: str, secret: bytes) -> Service:
    """A server of a job, on 127.0.0.1: "store", "task-store" (Spark's) or "log"."""
    if name == "store":
        from collectives.store import TCPStore

        return _store_service(name, TCPStore.serve("127.0.0.1", secret), secret)
    if name == "task-store":
        from horovod_spark._spark_store import SparkStore

        return _store_service(name, SparkStore("127.0.0.1", secret, "job", 0, 1, lambda m: [m]),
                              secret)
    return _log_service(secret)
