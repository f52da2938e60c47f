"""A zygote: a process that has imported a job's heavy modules and forks rank processes.

    python -m collectives.launch.zygote FD [MODULE ...]

Importing torch takes 1.5-3 s of CPU per process; a rank process forked from a
process that has already imported it starts in a few milliseconds.  The
zygote is started by its *owner* (`horovod_spark._job.warm`, in the process that
runs Spark tasks) with one end of an AF_UNIX SOCK_SEQPACKET socketpair as FD.
That socket is the zygote's only channel: no address, nothing listens, and
the kernel guarantees the peer is the owner that created the pair (so there is
no one to authenticate, and nothing is unpickled: messages are JSON).

Protocol (one JSON object per packet):

  zygote -> owner  {"ready": [imported...], "failed": {module: error}}   once, after the imports
  owner -> zygote  {"spawn": id, "env": {...}, "cwd": path}  + SCM_RIGHTS [stdout_w, stderr_w]
  zygote -> owner  {"spawn": id, "pid": pid}  or  {"spawn": id, "error": text}
  zygote -> owner  {"exit": pid, "status": rc}   rc as subprocess.Popen.returncode

A spawned child behaves as `python -m collectives.launch.worker` started with `env`
and `cwd` would: its own session (its pid is its process group, so the owner
kills it and its children with killpg), stdin from /dev/null, stdout and
stderr on the owner's pipes, a fresh seed for `random` and numpy's global
generator, torch's thread count from OMP_NUM_THREADS when the env sets it.
The zygote answers with the pid only after the child has left the zygote's
session, so a kill that follows the answer cannot miss it.

Lifetime: the zygote dies with the owner's thread that started it
(PR_SET_PDEATHSIG) and every child dies with the zygote, so killing the
owner's process (Spark kills the Python worker of a killed task) leaves
nothing behind; when the owner closes the socket, the zygote kills its
children and exits; it also exits after `HOROVOD_SPARK_ZYGOTE_IDLE_S` seconds (default
600) without a request or a living child.  Only fork-safe modules belong in
the preload list: the owner never preloads TensorFlow, Keras or JAX.
"""
from __future__ import annotations

import importlib
import json
import os
import select
import signal
import socket
import sys
import time
import traceback

from ..settings import ZYGOTE_IDLE_S
from .procs import die_with_parent

MAX_PACKET = 1 << 20


def returncode(status: int) -> int:
    """A wait status as subprocess.Popen.returncode: -signal, or the exit status."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


class Zygote:
    def __init__(self, sock: socket.socket, idle_s: float) -> None:
        self.sock, self.idle_s = sock, idle_s
        self.children: dict = {}  # pidfd -> pid
        self.last = time.monotonic()

    def send(self, obj: dict) -> None:
        self.sock.send(json.dumps(obj).encode())

    # -- the loop ----------------------------------------------------------
    def serve(self) -> int:
        while True:
            wait = max(self.idle_s - (time.monotonic() - self.last), 0.0) if not self.children \
                else None
            ready, _, _ = select.select([self.sock, *self.children], [], [], wait)
            if not ready and not self.children:
                return 0  # idle for idle_s: give the memory back
            for fd in ready:
                if fd is self.sock:
                    if not self.request():
                        return self.close()
                else:
                    self.reap(fd)
            self.last = time.monotonic()

    def request(self) -> bool:
        try:
            data, fds, _, _ = socket.recv_fds(self.sock, MAX_PACKET, 4)
        except OSError:
            return False
        if not data:
            for fd in fds:
                os.close(fd)
            return False  # the owner is gone
        try:
            msg = json.loads(data)
            if len(fds) != 2:
                raise ValueError(f"a spawn request needs 2 descriptors, got {len(fds)}")
            self.spawn(msg, fds)
        except Exception as exc:
            self.send({"spawn": msg.get("spawn") if isinstance(msg, dict) else None,
                       "error": f"{type(exc).__name__}: {exc}"})
        finally:
            for fd in fds:
                os.close(fd)
        return True

    def spawn(self, msg: dict, fds: list) -> None:
        sync_r, sync_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child never returns
            os.close(sync_r)
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
        self.children[os.pidfd_open(pid)] = pid
        self.send({"spawn": msg["spawn"], "pid": pid})

    def zygote_fds(self) -> list:
        return [self.sock.fileno(), *self.children]

    def reap(self, pidfd: int) -> None:
        pid = self.children.pop(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        self.send({"exit": pid, "status": returncode(status)})

    def close(self) -> int:
        for pidfd, pid in self.children.items():
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            os.waitpid(pid, 0)
            os.close(pidfd)
        self.children = {}
        return 0


def _child(env: dict, cwd, fds: list, sync_w: int, inherited: list) -> None:
    """The forked rank process: become what `python -m collectives.launch.worker` would be."""
    rc = 1
    try:
        os.setsid()
        parent = os.getppid()
        die_with_parent()
        if os.getppid() != parent:  # the zygote died before PR_SET_PDEATHSIG took
            os._exit(1)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (devnull, *fds, *inherited):
            os.close(fd)
        os.write(sync_w, b"1")
        os.close(sync_w)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as the interpreter sets it at start
        os.environ.clear()
        os.environ.update(env)
        if cwd:
            os.chdir(cwd)
        _fresh_state(env)
        sys.argv = ["-m"]
        from collectives.launch import worker

        rc = worker.main()
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


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    sock = socket.socket(fileno=int(argv[0]))
    idle_s = ZYGOTE_IDLE_S.read()
    try:
        os.close(os.pidfd_open(os.getpid()))  # Linux 5.3+: how the zygote watches its children
    except (AttributeError, OSError) as exc:
        sock.send(json.dumps({"unsupported": f"pidfd_open: {exc}"}).encode())
        return 0
    imported, failed = [], {}
    for name in argv[1:]:
        try:
            importlib.import_module(name)
            imported.append(name)
        except BaseException as exc:  # a broken module: the children import it themselves
            failed[name] = f"{type(exc).__name__}: {exc}"
    zygote = Zygote(sock, idle_s)
    try:
        zygote.send({"ready": imported, "failed": failed})
    except OSError:
        return 0
    return zygote.serve()


if __name__ == "__main__":
    sys.exit(main())
