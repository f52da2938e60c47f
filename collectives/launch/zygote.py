"""A zygote: a process that has imported a job's heavy modules and forks rank processes.

    python -m collectives.launch.zygote FD [--listen NAME --anchor PID] [MODULE ...]

Importing torch takes 1.5-3 s of CPU per process; a rank process forked from a
process that has already imported it starts in a few milliseconds.  The
zygote is started by its *owner* (`horovod_spark._job.warm`, in the process that
runs Spark tasks) with one end of an AF_UNIX SOCK_SEQPACKET socketpair as FD,
its first *connection*: the kernel guarantees that peer is the owner.  Nothing is
unpickled: messages are JSON.

The owner's first packet is the *token* (32 bytes), which the zygote keeps to prove
itself to later connections.  A *shared* zygote (``--listen``) also listens on NAME, an
abstract AF_UNIX address (no file), so that other processes of the same user can
connect: each accepted connection is checked by the kernel's peer credentials
(SO_PEERCRED: the same uid, or it is closed before a byte is read), then both ends
prove they hold the token (`zygote_auth`) before the zygote parses a byte of it; while
the zygote imports, a thread of its own answers the proofs.  It leaves its starter (a
second fork), so it outlives it, and lives as long as its *anchor*, the process PID (it
exits when the anchor does).  It stops listening when a connection asks it to *retire*
(a newer zygote takes its name), and exits once it has neither listener nor connection.

Protocol (after the token, or the proof; one JSON object per packet, on each connection):

  zygote -> owner  {"ready": [imported...], "failed": {module: error}}   first, after the imports
  owner -> zygote  {"spawn": id, "env": {...}, "cwd": path}
                   + SCM_RIGHTS [stdout_w, stderr_w, the rank end of the rank's channel]
  zygote -> owner  {"spawn": id, "pid": pid}  or  {"spawn": id, "error": text}
  zygote -> owner  {"exit": pid, "status": rc}   rc as subprocess.Popen.returncode
  owner -> zygote  {"retire": true}   stop listening (shared zygotes)

A spawned child is a keeper (`keeper.keep`) of a rank that behaves as `python -m
collectives.launch.worker` under `keeper.py`, started with `env` and `cwd`, would: its
own session (the keeper's pid is its process group), stdin from /dev/null, stdout and
stderr on the owner's pipes, its channel (HVS_CHANNEL names it), a fresh seed for
`random` and numpy's global generator, torch's thread count from OMP_NUM_THREADS when
the env sets it.  The zygote answers with the keeper's pid only after it has left the
zygote's session, so a stop that follows the answer cannot miss it.  The child wipes its
copy of the token before anything else: a rank never holds it.

Lifetime: a private zygote dies with the owner's thread that started it
(PR_SET_PDEATHSIG), a shared one with its anchor, and every child dies with the
zygote.  When a connection closes (its owner's process was killed, or closed it),
the zygote stops the children that connection asked for (`procs.stop_kept`'s way); a
private zygote then exits.  A zygote also exits after `HOROVOD_SPARK_ZYGOTE_IDLE_S` seconds (default
600) without a request or a living child.  Only fork-safe modules belong in the
preload list: the owner never preloads TensorFlow, Keras or JAX.
"""
from __future__ import annotations

import importlib
import json
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from typing import Optional

from ..settings import ZYGOTE_IDLE_S
from . import keeper
from .channel import CHANNEL_VAR
from .procs import STOP_GRACE_S, die_with_parent
from .zygote_auth import TOKEN_BYTES, Proof

MAX_PACKET = 1 << 20
#: Named connections still proving themselves, at most (the oldest is dropped beyond).
MAX_PENDING = 64


def returncode(status: int) -> int:
    """A wait status as subprocess.Popen.returncode: -signal, or the exit status."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


class Zygote:
    def __init__(self, sock: socket.socket, idle_s: float, token: bytearray,
                 listener: Optional[socket.socket] = None, anchor: Optional[int] = None) -> None:
        self.idle_s, self.token, self.greeting = idle_s, token, None
        self.listener, self.anchor = listener, anchor  # anchor: a pidfd
        self.conns: dict = {sock: set()}  # connection -> pidfds of the children it asked for
        self.pending: dict = {}  # named connection -> its Proof, until it is proved
        self.children: dict = {}  # pidfd -> (pid, connection)
        self.last = time.monotonic()

    def send(self, conn: socket.socket, obj: dict) -> None:
        try:
            conn.send(json.dumps(obj).encode())
        except OSError:  # it closed: its children are killed when select sees that
            pass

    # -- the loop ----------------------------------------------------------
    def serve(self, greeting: dict) -> int:
        self.greeting = greeting
        for conn in self.conns:
            self.send(conn, greeting)
        while self.conns or self.listener is not None:
            idle = max(self.idle_s - (time.monotonic() - self.last), 0.0) if not self.children \
                else None
            watched = [*self.conns, *self.pending, *self.children, *self._extra()]
            ready, _, _ = select.select(watched, [], [], self._wait(idle))
            self.expire()
            if not ready and not self.children and time.monotonic() - self.last >= self.idle_s:
                break  # idle for idle_s: give the memory back
            for fd in ready:
                if fd is self.listener:
                    self.accept()
                elif isinstance(fd, int) and fd == self.anchor:
                    return self.close()
                elif fd in self.pending:
                    self.prove(fd)
                elif fd in self.conns:
                    self.request(fd)
                    self.last = time.monotonic()
                elif fd in self.children:
                    self.reap(fd)
                    self.last = time.monotonic()
        return self.close()

    def admit_while_importing(self, done: threading.Event, wake: int) -> None:
        """A thread's loop while the main thread imports: accept and prove named connections
        (their greeting follows the imports), so a task's proof is answered in milliseconds.
        It ends, and is joined, before the zygote forks anything."""
        while not done.is_set():
            watched = [*self.pending, self.listener, wake]
            ready, _, _ = select.select(watched, [], [], self._wait(None))
            self.expire()
            for fd in ready:
                if fd is self.listener:
                    self.accept()
                elif fd in self.pending:
                    self.prove(fd)

    def _wait(self, idle: Optional[float]) -> Optional[float]:
        """select's timeout: the idle time left, or the first proof's deadline if sooner."""
        if not self.pending:
            return idle
        due = max(min(p.deadline for p in self.pending.values()) - time.monotonic(), 0.0)
        return due if idle is None else min(idle, due)

    def _extra(self) -> list:
        return [fd for fd in (self.listener, self.anchor) if fd is not None]

    def accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        if peer_uid(conn) != os.geteuid():  # before a byte is read
            conn.close()
            return
        if len(self.pending) >= MAX_PENDING:  # a flood of silent connections: drop the oldest
            oldest = next(iter(self.pending))
            del self.pending[oldest]
            oldest.close()
        self.pending[conn] = Proof(self.token)

    def prove(self, conn: socket.socket) -> None:
        """One packet of a named connection's proof; proved, it is a connection like the first."""
        try:
            proved = self.pending[conn].step(conn)
        except (OSError, ValueError):  # not the session's: closed, nothing parsed
            del self.pending[conn]
            conn.close()
            return
        if proved:
            del self.pending[conn]
            self.conns[conn] = set()
            if self.greeting is not None:
                self.send(conn, self.greeting)

    def expire(self) -> None:
        now = time.monotonic()
        for conn in [c for c, p in self.pending.items() if p.deadline <= now]:
            del self.pending[conn]
            conn.close()

    def request(self, conn: socket.socket) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(conn, MAX_PACKET, 4)
        except OSError:
            data, fds = b"", []
        if not data:
            for fd in fds:
                os.close(fd)
            return self.drop(conn)  # its owner is gone
        msg = None
        try:
            msg = json.loads(data)
            if msg.get("retire"):
                return self.retire()
            if len(fds) != 3:
                raise ValueError(f"a spawn request needs 3 descriptors, got {len(fds)}")
            self.spawn(conn, msg, fds)
        except Exception as exc:
            self.send(conn, {"spawn": msg.get("spawn") if isinstance(msg, dict) else None,
                             "error": f"{type(exc).__name__}: {exc}"})
        finally:
            for fd in fds:
                os.close(fd)

    def retire(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    def spawn(self, conn: socket.socket, msg: dict, fds: list) -> None:
        sync_r, sync_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child never returns
            os.close(sync_r)
            self.token[:] = bytes(len(self.token))  # a rank never holds the session's token
            _child(msg["env"], msg.get("cwd"), fds, sync_w, self.zygote_fds())
        os.close(sync_w)
        try:
            ok = select.select([sync_r], [], [], 30.0)[0] and os.read(sync_r, 1) == b"1"
        finally:
            os.close(sync_r)
        if not ok:  # it died (or hung) before leaving our session
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            raise RuntimeError("the forked rank process died before it started")
        pidfd = os.pidfd_open(pid)
        self.children[pidfd] = (pid, conn)
        self.conns[conn].add(pidfd)
        self.send(conn, {"spawn": msg["spawn"], "pid": pid})

    def zygote_fds(self) -> list:
        return [*(c.fileno() for c in (*self.conns, *self.pending)), *self.children,
                *(fd if isinstance(fd, int) else fd.fileno() for fd in self._extra())]

    def reap(self, pidfd: int) -> None:
        pid, conn = self.children.pop(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        if conn in self.conns:
            self.conns[conn].discard(pidfd)
            self.send(conn, {"exit": pid, "status": returncode(status)})

    def drop(self, conn: socket.socket) -> None:
        """A connection closed: kill the children it asked for."""
        for pidfd in self.conns.pop(conn, ()):
            pid, _ = self.children.pop(pidfd)
            _kill(pid, pidfd)
        conn.close()

    def close(self) -> int:
        for pidfd, (pid, _) in self.children.items():
            _kill(pid, pidfd)
        self.children = {}
        return 0


def _kill(pid: int, pidfd: int) -> None:
    """Stop a keeper: SIGTERM (it kills its rank and what the rank left), then, if it is
    still there after STOP_GRACE_S, SIGKILL to its process group; reap it."""
    try:
        os.kill(pid, signal.SIGTERM)
        select.select([pidfd], [], [], STOP_GRACE_S)
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    os.waitpid(pid, 0)
    os.close(pidfd)


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of an AF_UNIX connection, from the kernel."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def _child(env: dict, cwd, fds: list, sync_w: int, inherited: list) -> None:
    """The forked keeper: its own session, then the rank it forks (see keeper.py)."""
    try:
        os.setsid()
        parent = os.getppid()
        keeper._prctl(keeper.PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the zygote died before PR_SET_PDEATHSIG took
            os._exit(1)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (devnull, fds[0], fds[1], *inherited):
            os.close(fd)
        os.write(sync_w, b"1")
        os.close(sync_w)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        keeper.keep(lambda: _fork_rank(env, cwd, fds[2]))
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(1)


def _fork_rank(env: dict, cwd, channel: int) -> int:
    """Fork the rank: what `python -m collectives.launch.worker` would be; returns its pid."""
    pid = os.fork()
    if pid:
        os.close(channel)
        return pid
    rc = 1
    try:
        die_with_parent()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as the interpreter sets it at start
        os.environ.clear()
        os.environ.update(env)
        os.environ[CHANNEL_VAR] = f"{channel}:{os.fstat(channel).st_ino}"
        if cwd:
            os.chdir(cwd)
        _fresh_state(env)
        sys.argv = ["-m"]
        from collectives.launch import worker

        worker.leave(worker.main())  # the exit handlers, then os._exit, as a fresh rank
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(rc)


def _fresh_state(env: dict) -> None:
    """What a fresh interpreter would not share with its siblings."""
    import random

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    threads = env.get("OMP_NUM_THREADS", "")
    if "torch" in sys.modules and threads.isdigit() and int(threads) > 0:
        sys.modules["torch"].set_num_threads(int(threads))


def _listen(name: str) -> Optional[socket.socket]:
    """A listener on the abstract address `name`, or None where another process has it."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        listener.bind("\0" + name)
        listener.listen(16)
        return listener
    except OSError:
        listener.close()
        return None


def _leave_starter() -> None:
    """Fork once more and let the first process exit: the zygote outlives its starter."""
    if os.fork() != 0:
        os._exit(0)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    sock = socket.socket(fileno=int(argv.pop(0)))
    name = anchor = None
    while argv[:1] in (["--listen"], ["--anchor"]):
        flag, value = argv.pop(0), argv.pop(0)
        name, anchor = (value, anchor) if flag == "--listen" else (name, int(value))
    idle_s = ZYGOTE_IDLE_S.read()
    try:
        anchor_fd = os.pidfd_open(anchor) if anchor is not None else None
        os.close(os.pidfd_open(os.getpid()))  # Linux 5.3+: how the zygote watches its children
    except (AttributeError, OSError) as exc:
        sock.send(json.dumps({"unsupported": f"pidfd_open: {exc}"}).encode())
        return 0
    token = _read_token(sock)
    if token is None:
        return 0  # not started by an owner that holds a token: serve nobody
    if name is not None:
        _leave_starter()
    # before the imports, so a job that comes meanwhile waits for them rather than start
    # cold; taken (a retired zygote has not let go yet): again after them, else it stays private
    zygote = Zygote(sock, idle_s, token, _listen(name) if name is not None else None, anchor_fd)
    imported, failed = _imports(zygote, argv)
    if name is not None and zygote.listener is None:
        zygote.listener = _listen(name)
    return zygote.serve({"ready": imported, "failed": failed})


def _read_token(sock: socket.socket) -> Optional[bytearray]:
    """The owner's first packet: the token named connections must prove they hold."""
    sock.settimeout(30.0)
    try:
        token = bytearray(sock.recv(TOKEN_BYTES + 1))
    except OSError:
        return None
    finally:
        sock.settimeout(None)
    return token if len(token) == TOKEN_BYTES else None


def _imports(zygote: Zygote, modules: list):
    """Import `modules` while a thread admits named connections; (imported, failed)."""
    imported, failed = [], {}
    done, (wake_r, wake_w) = threading.Event(), os.pipe()
    admitter = None
    if zygote.listener is not None and modules:
        admitter = threading.Thread(target=zygote.admit_while_importing, args=(done, wake_r),
                                    name="hvs-zygote-admit", daemon=True)
        admitter.start()
    try:
        for module in modules:
            try:
                importlib.import_module(module)
                imported.append(module)
            except BaseException as exc:  # a broken module: the children import it themselves
                failed[module] = f"{type(exc).__name__}: {exc}"
    finally:
        done.set()
        os.write(wake_w, b"x")
        if admitter is not None:
            admitter.join()  # no thread of ours is left when the zygote forks
        os.close(wake_r)
        os.close(wake_w)
    return imported, failed


if __name__ == "__main__":
    sys.exit(main())
