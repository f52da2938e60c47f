"""The log channel: rank output and failure records from tasks to the driver.

Terms.  A *task* is one barrier task on an executor; it owns one rank process
and a *log client*.  The *log server* runs on the driver, bound to the
driver's address.  A *frame* is a 4-byte big-endian length, a JSON object and
its tag (the connection's `auth.Channel`: a frame injected, changed or replayed
after the handshake fails it, and the connection is dropped);
nothing on this channel is ever a pickle.  Every connection runs the mutual
HMAC handshake of `collectives.rendezvous.auth` (context "log") before its first frame
is read, and then a `hello` frame naming the job and rank.

Frames, task -> driver:
    {"t": "hello", "job", "rank"}          once, first
    {"t": "out", "s": "stdout"|"stderr"|"cb", "x": line}
    {"t": "fail", "rec": failure record}  the rank failed (see `markers`)
    {"t": "done"}                          every line of this rank was sent
driver -> task:
    {"t": "abort"}                         the job failed: kill your rank now

The channel is best effort by design: a client that cannot connect, or loses
its connection, drops lines and counts them, and never raises into the task;
the server never lets a bad peer or a failing output stream stop the job.
While it is up, a client that cannot keep up holds the rank's output back
(its queue is full: the task stops reading the rank's pipe) for up to
LINE_WAIT_S per line before it drops one, and says how many it dropped.  A
rank's output is cut into lines at newlines, at carriage returns (progress
bars) and every MAX_LINE bytes (`split_lines`), so no frame nears MAX_FRAME;
the server skips a frame over MAX_FRAME instead of hanging up.
Failures also travel in the task's exception text (`markers`), so the driver names
the failing rank even without this channel.
"""
from __future__ import annotations

import json
import queue
import re
import socket
import struct
import sys
import threading
import time
from typing import Callable, Optional

from collectives.errors import AuthenticationError, CollectiveError
from collectives.rendezvous.accept import BACKLOG, AcceptGate, accept_loop

from ..progress.marks import CALLBACK_MARK  # a line a rank wrote with `log_to_driver`

__all__ = ["LogServer", "LogClient", "LineSink",
           "CALLBACK_MARK"]

MAX_FRAME = 1 << 20
#: A frame claiming more than this is no log frame: the server hangs up.
_MAX_SKIP = 64 << 20
#: Bytes of rank output in one line frame; a longer line is cut into pieces this long.
MAX_LINE = 64 * 1024
#: Seconds the task waits for room in a full queue before it drops a line.
LINE_WAIT_S = 30.0
#: Characters of a failure record's message and traceback that travel on the channel.
_MAX_FIELD = 200 * 1024
def close_listener(listener: socket.socket) -> None:
    """Close a listening socket and wake its accept() (close alone does not, on Linux)."""
    try:
        listener.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        listener.close()
    except OSError:
        pass


def split_lines(pipe, limit: int = MAX_LINE):
    """The lines of a binary pipe, split at \n, \r\n and \r and cut every `limit` bytes, so
    no line grows without bound (a progress bar redraws with \r and never ends a line)."""
    buf = b""
    while True:
        chunk = pipe.read1(1 << 16)
        if not chunk:
            break
        buf += chunk
        held = buf.endswith(b"\r")  # maybe the first half of \r\n
        lines = re.split(rb"\r\n|\n|\r", buf[:-1] if held else buf)
        buf = lines.pop() + (b"\r" if held else b"")
        for line in lines:
            yield from _cut(line, limit)
        while len(buf) >= limit:
            yield buf[:limit]
            buf = buf[limit:]
    if buf.rstrip(b"\r"):
        yield buf.rstrip(b"\r")


def _cut(line: bytes, limit: int):
    if not line:
        yield line
    for at in range(0, len(line), limit):
        yield line[at:at + limit]


def _discard(sock: socket.socket, n: int, running) -> None:
    from collectives.rendezvous.auth import recv_exact

    while n > 0:
        chunk = recv_exact(sock, min(n, 1 << 16))
        running.update(chunk)
        n -= len(chunk)


def send_frame(sock: socket.socket, obj: dict, channel) -> None:
    """One frame: length, JSON, and its tag from the connection's auth.Channel."""
    data = json.dumps(obj, separators=(",", ":")).encode()
    head = struct.pack(">I", len(data))
    sock.sendall(head + data + channel.seal(head, data))


def recv_frame(sock: socket.socket, channel) -> Optional[dict]:
    """The next frame, or None at a clean EOF; ValueError for a bad frame; a frame over
    MAX_FRAME (up to _MAX_SKIP) is read past and stands as {"t": "skipped"}.  Its tag is
    checked (AuthenticationError) before its JSON is parsed."""
    from collectives.rendezvous.auth import MAC, recv_exact

    try:
        head = recv_exact(sock, 4)
    except ConnectionError:
        return None
    (n,) = struct.unpack(">I", head)
    if n > _MAX_SKIP:
        raise ValueError(f"log frame of {n} bytes is over the {_MAX_SKIP} byte limit")
    running = channel.opening()
    running.update(head)
    if n > MAX_FRAME:  # skipped (read past, never held), not a reason to hang up
        _discard(sock, n, running)
        channel.check(running, recv_exact(sock, MAC))
        return {"t": "skipped", "n": n}
    data = recv_exact(sock, n)
    running.update(data)
    channel.check(running, recv_exact(sock, MAC))
    obj = json.loads(data)
    if not isinstance(obj, dict):
        raise ValueError("log frame is not a JSON object")
    return obj


class LineSink:
    """Writes rank lines Horovod's way, `[1]<stdout>:text`, to the driver's streams.

    The streams are looked up at each write, so a notebook's `sys.stdout` (which
    the kernel swaps per cell) receives the lines of the cell that runs the job.
    """

    def __init__(self, stdout=None, stderr=None, show_output: bool = True,
                 timestamps: bool = False) -> None:
        self._stdout, self._stderr = stdout, stderr
        self.show_output, self.timestamps = show_output, timestamps
        self._lock = threading.Lock()

    def write(self, rank: int, stream: str, text: str) -> None:
        if stream != "cb" and not self.show_output:
            return
        label = "stderr" if stream == "stderr" else "stdout"
        target = (self._stderr or sys.stderr) if label == "stderr" else (self._stdout or sys.stdout)
        stamp = time.strftime("%a %b %d %H:%M:%S %Y") + ":" if self.timestamps else ""
        try:  # a failing output stream never fails the job
            with self._lock:
                target.write(f"{stamp}[{rank}]<{label}>:{text}\n")
                target.flush()
        except Exception:
            pass


class LogServer:
    """Driver side of the log channel for one job attempt."""

    def __init__(self, bind: str, secret: bytes, job: str, sink: LineSink,
                 handshake_timeout: float = 10.0) -> None:
        self._secret, self.job, self.sink = secret, job, sink
        self._timeout = handshake_timeout
        self._listener = socket.create_server((bind, 0), backlog=BACKLOG)
        host, port = self._listener.getsockname()[:2]
        self.address = f"{host}:{port}"
        self._cond = threading.Condition()
        self._conns: dict = {}
        self.failures: list = []   # failure records, in order of arrival
        self.done: set = set()     # ranks whose every line arrived
        self.hosts: dict = {}      # rank -> the address its task connected from
        self.rejected = 0          # connections that failed the handshake or the hello
        self._closed = False
        self._gate = AcceptGate()
        threading.Thread(target=self._accept_loop, name="hvs-log-accept", daemon=True).start()

    def _accept_loop(self) -> None:
        accept_loop(self._listener, lambda: self._closed, self._gate, self._admitted)

    def _admitted(self, conn: socket.socket) -> None:
        threading.Thread(target=self._serve, args=(conn,), name="hvs-log", daemon=True).start()

    def _hello(self, conn: socket.socket):
        """(rank, channel) of a connection that authenticated and said hello, else None."""
        from collectives.rendezvous.auth import server_handshake
        from collectives.errors import AuthenticationError

        try:
            channel = server_handshake(conn, self._secret, "log", self._timeout)
            conn.settimeout(self._timeout)
            hello = recv_frame(conn, channel)
            conn.settimeout(None)
        except (AuthenticationError, OSError, ValueError):
            hello = None
        finally:
            self._gate.release(conn)
        if not hello or hello.get("t") != "hello" or hello.get("job") != self.job:
            with self._cond:
                self.rejected += 1
                self._cond.notify_all()
            return None
        return int(hello.get("rank", -1)), channel

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            hello = self._hello(conn)
            if hello is None:
                return
            rank, channel = hello
            with self._cond:
                self._conns[rank] = (conn, channel)
                try:
                    self.hosts[rank] = conn.getpeername()[0]
                except OSError:
                    pass
            try:
                while self._handle(rank, recv_frame(conn, channel)):
                    pass
            except (OSError, ValueError, CollectiveError):  # a bad tag: dropped, not acted on
                pass
            finally:
                with self._cond:
                    self._conns.pop(rank, None)
                    self._cond.notify_all()

    def _handle(self, rank: int, frame: Optional[dict]) -> bool:
        if frame is None:
            return False
        kind = frame.get("t")
        if kind == "out":
            self.sink.write(rank, str(frame.get("s")), str(frame.get("x")))
        with self._cond:
            if kind == "fail" and isinstance(frame.get("rec"), dict):
                self.failures.append(frame["rec"])
            elif kind == "done":
                self.done.add(rank)
            self._cond.notify_all()  # `wait` predicates may look at anything a frame changed
        return True

    def wait(self, predicate: Callable[[], bool], timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(predicate, timeout)

    def wait_done(self, ranks, timeout: float) -> bool:
        """Wait until every rank in `ranks` sent its last line (or the timeout)."""
        want = set(ranks)
        return self.wait(lambda: want <= self.done, timeout)

    def wait_disconnected(self, timeout: float) -> bool:
        return self.wait(lambda: not self._conns, timeout)

    def abort_all(self) -> None:
        """Ask every connected task to kill its rank now (best effort)."""
        with self._cond:
            conns = list(self._conns.values())
        for conn, channel in conns:
            try:
                send_frame(conn, {"t": "abort"}, channel)
            except OSError:
                pass

    def close(self) -> None:
        self._closed = True
        close_listener(self._listener)
        with self._cond:
            conns = [conn for conn, _ in self._conns.values()]
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class LogClient:
    """Task side of the log channel.  Never raises; drops lines when it must."""

    def __init__(self, address: Optional[str], secret: bytes, job: str, rank: int,
                 on_abort: Optional[Callable[[], None]] = None, connect_timeout: float = 5.0,
                 max_queued: int = 10000) -> None:
        self.address, self.rank = address, rank
        self._secret, self._job, self._on_abort = secret, job, on_abort
        self._connect_timeout = connect_timeout
        self._q: queue.Queue = queue.Queue(maxsize=max_queued)
        self._sock: Optional[socket.socket] = None
        self.broken = address is None
        self.dropped = 0
        self.error: Optional[BaseException] = None  # why the channel could not be opened
        self._sender = threading.Thread(target=self._send_loop, name="hvs-log-send", daemon=True)
        self._sender.start()

    def _connect(self) -> socket.socket:
        from collectives.rendezvous.auth import client_handshake, cut_short

        host, port = self.address.rsplit(":", 1)
        deadline = time.monotonic() + self._connect_timeout
        while True:  # a handshake a busy server cut short is tried again, within the timeout,
            left = max(deadline - time.monotonic(), 0.1)  # as a connection it refused or reset
            try:  # (its backlog overflowing: thousands of tasks at once)
                sock = socket.create_connection((host, int(port)), timeout=left)
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
                continue
            try:
                self._channel = client_handshake(sock, self._secret, "log", left)
                break
            except AuthenticationError as exc:
                sock.close()
                if not cut_short(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        send_frame(sock, {"t": "hello", "job": self._job, "rank": self.rank}, self._channel)
        return sock

    def _send_loop(self) -> None:
        if not self.broken:
            try:
                self._sock = self._connect()
                threading.Thread(target=self._recv_loop, args=(self._sock,),
                                 name="hvs-log-recv", daemon=True).start()
            except Exception as exc:
                self.broken, self.error = True, exc
        while True:
            frame = self._q.get()
            if frame is None:
                return
            if self.broken:
                self.dropped += frame.get("t") == "out"
                continue
            try:
                send_frame(self._sock, frame, self._channel)
            except OSError:
                self.broken = True
                self.dropped += 1

    def _recv_loop(self, sock: socket.socket) -> None:
        try:
            while True:
                frame = recv_frame(sock, self._channel)
                if frame is None:
                    return
                if frame.get("t") == "abort" and self._on_abort is not None:
                    self._on_abort()
        except Exception:
            return

    def _put(self, frame: dict, wait: float) -> None:
        try:
            self._q.put(frame, block=wait > 0, timeout=wait if wait > 0 else None)
        except queue.Full:
            self.dropped += 1

    def line(self, stream: str, text: str) -> None:
        """Queue one line; while the channel is up, wait for room (back-pressure on the rank)."""
        self._put({"t": "out", "s": stream, "x": text[:MAX_LINE]},
                  0.0 if self.broken else LINE_WAIT_S)

    def failure(self, record: dict) -> None:
        record = {k: (v[:_MAX_FIELD] + " [cut]" if isinstance(v, str) and len(v) > _MAX_FIELD
                      else v) for k, v in record.items()}
        self._put({"t": "fail", "rec": record}, 1.0)

    def close(self, timeout: float = 3.0) -> None:
        """Send what is queued (up to `timeout`), say what was dropped and done, and hang up."""
        if self.dropped:
            self._put({"t": "out", "s": "cb", "x": f"rank {self.rank}: {self.dropped} lines of "
                       "output dropped (the log channel to the driver could not keep up, or "
                       "was lost)"}, 1.0)
        self._put({"t": "done"}, 1.0)
        try:
            self._q.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._sender.join(timeout)
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
