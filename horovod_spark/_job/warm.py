"""Warm starts: a task's rank process forked from a zygote that has imported the job's modules.

A rank process starts as `python -m collectives.launch.worker` and then imports what
its function needs; torch alone costs 1.5-3 s of CPU, paid by every rank of
every job, while the task's partition waits.  After a job, the executor
keeps a *zygote* (`collectives.launch.zygote`): a process with the same interpreter
and environment as the rank that has imported the fork-safe heavy modules the
last job's rank imported.  The next job's rank on that executor is forked from it
and starts in milliseconds.

The zygote is the executor's, not the Python worker's: Spark stops Python workers
idle for a minute, and a DataFrame stage's Arrow workers are not the RDD stage's.
A *shared* zygote listens on an abstract AF_UNIX name made of the uid, the worker's
parent (the *anchor*: the executor's Python daemon), the key and the session's token's
public digest, and lives as long as the anchor; a later worker connects to it by that
name and, before it hands it a byte or a descriptor of a job, has it prove that it holds
the session's *token* (`collectives.launch.zygote_auth`): 32 random bytes the driver
makes once per process and sends in the task spec, never in an environment.  A holder
of the name that fails the proof or stays silent (a process of the same user that killed
the zygote and bound its name) gets nothing: the task starts its rank fresh, on a fresh
channel, and says so on the driver.

Terms.  An *owner* is this module in a Python worker, holding one connection to a
zygote: the private socketpair of the zygote it started (its first packet is the
token), or one accepted on the zygote's name after the kernel vouched for the same uid
at both ends and the zygote proved it holds the token (see `collectives.launch.zygote`).
The zygote's *key* is its interpreter and the rank environment without the
per-job variables (HVS_*, HOROVOD_RANK..., torchrun's): a job whose environment differs
(another PYTHONPATH, OMP_NUM_THREADS, a user variable) starts its ranks
fresh and leaves a zygote of its own key.  The *report*: a rank started with
HVS_WARM_REPORT sends which of those modules it imported on its channel; the task
reads it when the rank has succeeded and prepares the
zygote, in the background, for the next job.

What is never warm: a rank with GPUs (a CUDA context must not cross a fork),
TensorFlow, Keras and JAX (not fork-safe once imported; a rank that uses
them still forks from a zygote of numpy/pyarrow), and any job run with
HOROVOD_SPARK_WARM_START=0 on the driver or in its `env`.  A zygote that
cannot start, dies or does not answer makes the task start its rank the
ordinary way.

Lifetime: the zygote dies with its anchor, forked ranks die with the zygote or
with the connection that asked for them (a killed worker), and a zygote exits after
HOROVOD_SPARK_ZYGOTE_IDLE_S (default 600) seconds without a job.  A job that imports
more leaves a zygote with the union, which takes the name; the one before stops
listening and exits when its last owner lets go.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import threading
from typing import Mapping, Optional, Tuple

from collectives.launch import frameworks, torchrun
from collectives.launch.procs import die_with_parent
from collectives.launch.zygote import MAX_PACKET, peer_uid
from collectives.launch.zygote_auth import ZygoteUntrusted, prove_to_zygote, token_digest

__all__ = ["spawn", "learn", "shutdown", "session_token", "WarmChild", "ZygoteUntrusted",
           "REPORT"]

log = logging.getLogger("horovod_spark.warm")

#: Fork-safe modules worth preloading, in import order; a rank reports which it imported.
#: Not torch._dynamo, although a torch optimizer's first step imports it (about 0.7 s): with it
#: imported before a Gloo process group exists, torch 2.13 deadlocks in about one job in three
#: that destroys its group and then frees its DDP model (the destructor joins Gloo's worker
#: with the GIL held, while the worker needs the GIL to drop a work's thread-local state).
REPORT = ("numpy", "pyarrow", "pandas", "scipy", "sklearn", "torch",
          "torchvision", "horovod_spark.torch")
#: A zygote is kept only for a job that imported one of these (the rest is cheap).
HEAVY = ("pyarrow", "pandas", "scipy", "sklearn", "torch", "torchvision")
_RANK_KEYS = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
              "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE")
READY_TIMEOUT_S = 60.0  # a zygote still importing: wait this long before starting fresh
ANSWER_TIMEOUT_S = 30.0

_lock = threading.Lock()
_zygote: Optional["_Owner"] = None
_token: Optional[bytes] = None
#: Names whose holder failed its proof in this worker: not asked again (it holds the name
#: until it exits; this worker's next zygote is its own).
_untrusted: set = set()


def session_token() -> bytes:
    """The driver's token for the zygotes of its jobs' tasks: made once per driver process
    (its Spark session), sent in every task spec."""
    global _token
    with _lock:
        if _token is None:
            _token = os.urandom(32)
        return _token


def zygote_env(env: Mapping[str, str]) -> dict:
    """The rank environment without its per-job variables: the zygote's own."""
    return {k: v for k, v in env.items() if not k.startswith("HVS_") and k not in _RANK_KEYS
            and k not in torchrun.VARIABLES and k not in frameworks.VARIABLES}


def _key(executable: str, env: Mapping[str, str]) -> tuple:
    return (executable, tuple(sorted(zygote_env(env).items())))


def address(key: tuple, anchor: int, token: bytes) -> str:
    """The abstract AF_UNIX name of the shared zygote of `key` under `anchor` for the session
    of `token` (another session's zygotes have other names)."""
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]
    return f"horovod-spark-zygote-{os.geteuid()}-{anchor}-{token_digest(token)}-{digest}"


class WarmChild:
    """A forked rank process, as much of subprocess.Popen as the task uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: Optional[int] = None
        self.stdout = self.stderr = None
        self._exited_event = threading.Event()

    def _exited(self, rc: int) -> None:
        if self.returncode is None:
            self.returncode = rc
            self._exited_event.set()

    def poll(self) -> Optional[int]:
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if not self._exited_event.wait(timeout):
            raise subprocess.TimeoutExpired(f"rank process {self.pid} (forked)", timeout)
        return self.returncode


class _Owner:
    """One zygote: started on its own thread, which then reads its messages until it ends."""

    def __init__(self, executable: str, env: Mapping[str, str], modules: list, token: bytes,
                 listen: Optional[Tuple[str, int]] = None,
                 sock: Optional[socket.socket] = None) -> None:
        """Start a zygote (private, or shared with listen=(name, anchor)), or own the
        connection `sock` to a shared one, which has proved it holds `token`."""
        self.key, self.modules, self.token = _key(executable, env), list(modules), token
        self.attached = sock is not None  # to another worker's zygote
        self.ready = threading.Event()
        self.dead: Optional[str] = None
        self.proc: Optional[subprocess.Popen] = None
        self._cond = threading.Condition()
        self._answers: dict = {}
        self._children: dict = {}
        self._next = 0
        target, args = self._read, ()
        if sock is not None:
            self.sock = sock
        else:
            self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            if listen:  # started now, so it outlives a worker stopped right after this job
                self._start(executable, zygote_env(env), theirs, listen)
            else:
                target, args = self._run, (executable, zygote_env(env), theirs)
        self._thread = threading.Thread(target=target, name="hvs-zygote-owner", args=args,
                                        daemon=True)
        self._thread.start()

    def _start(self, executable: str, env: dict, theirs: socket.socket,
               listen: Optional[Tuple[str, int]]) -> bool:
        shared = ["--listen", listen[0], "--anchor", str(listen[1])] if listen else []
        try:
            try:
                fd = theirs.fileno()
                self.proc = subprocess.Popen(
                    [executable, "-m", "collectives.launch.zygote", str(fd), *shared,
                     *self.modules], env=env, pass_fds=(fd,), stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL, start_new_session=True,
                    preexec_fn=None if listen else die_with_parent)
            finally:
                theirs.close()
            self.sock.send(self.token)  # its first packet: what it proves itself with
        except Exception as exc:  # cannot start
            self._die(f"{type(exc).__name__}: {exc}")
            return False
        return True

    # -- the owner's thread: it started a private zygote, which dies with it --
    def _run(self, executable: str, env: dict, theirs: socket.socket) -> None:
        if self._start(executable, env, theirs, None):
            self._receive()

    def _read(self) -> None:
        if self.dead is not None:  # it could not start
            return
        if self.proc is not None:
            self.proc.wait()  # a shared zygote's starter, which the zygote leaves (a second fork)
        self._receive()

    def _receive(self) -> None:
        try:
            while True:
                data = self.sock.recv(MAX_PACKET)
                if not data:
                    break
                self._on(json.loads(data))
            self._die("the zygote exited")
        except Exception as exc:  # the socket broke
            self._die(f"{type(exc).__name__}: {exc}")
        finally:
            if self.proc is not None:
                self.proc.wait()

    def _on(self, msg: dict) -> None:
        if "ready" in msg:
            if msg.get("failed"):
                log.info("zygote could not import %s", msg["failed"])
            if self.attached:  # what another worker's zygote has
                self.modules = [m for m in REPORT if m in msg["ready"] or m in msg["failed"]]
            self.ready.set()
        elif "unsupported" in msg:
            self._die(msg["unsupported"])
        elif "spawn" in msg:
            child = WarmChild(msg["pid"]) if "pid" in msg else None
            with self._cond:
                if child is not None:
                    self._children[child.pid] = child
                self._answers[msg["spawn"]] = child if child is not None else msg.get("error", "?")
                self._cond.notify_all()
        elif "exit" in msg:
            with self._cond:
                child = self._children.pop(msg["exit"], None)
            if child is not None:
                child._exited(msg["status"])

    def _die(self, why: str) -> None:
        with self._cond:
            if self.dead is None:
                self.dead = why
            children, self._children = self._children, {}
            self._cond.notify_all()
        self.ready.set()
        for child in children.values():  # they die with the zygote (PR_SET_PDEATHSIG)
            child._exited(-signal.SIGKILL)

    # -- any thread --------------------------------------------------------
    def spawn(self, env: Mapping[str, str], cwd: str, channel: int) -> Optional[WarmChild]:
        """A rank forked with `env` in `cwd`, holding `channel` (the rank end of its channel)."""
        if not self.ready.wait(READY_TIMEOUT_S) or self.dead is not None:
            return None
        with self._cond:
            self._next += 1
            ident = self._next
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            socket.send_fds(self.sock, [json.dumps({"spawn": ident, "env": dict(env),
                                                    "cwd": cwd}).encode()],
                            [out_w, err_w, channel])
            with self._cond:
                self._cond.wait_for(lambda: ident in self._answers or self.dead is not None,
                                    ANSWER_TIMEOUT_S)
                answer = self._answers.pop(ident, None)
        except OSError as exc:
            answer = f"{type(exc).__name__}: {exc}"
        finally:
            os.close(out_w)
            os.close(err_w)
        if not isinstance(answer, WarmChild):
            os.close(out_r)
            os.close(err_r)
            if answer is None and self.dead is None:  # silent: do not trust this zygote again
                self.close()
                raise ZygoteUntrusted(f"the executor's zygote did not answer a spawn request "
                                      f"in {ANSWER_TIMEOUT_S:g} s")
            log.info("no warm start (%s); starting the rank process fresh", answer or self.dead)
            return None
        answer.stdout, answer.stderr = os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb")
        return answer

    def close(self) -> None:
        """Let go: the zygote sees the connection close and kills the children it asked for;
        a private zygote then exits."""
        with self._cond:
            if self.dead is None:
                self.dead = "closed by its owner"
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the owner's thread's recv
        except OSError:
            pass
        self.sock.close()

    def retire(self) -> None:
        """Ask a shared zygote to stop listening (a newer one takes its name), and let go."""
        try:
            self.sock.send(json.dumps({"retire": True}).encode())
        except OSError:
            pass
        self.close()


def _attach(key: tuple, anchor: int, token: bytes) -> Optional[_Owner]:
    """An owner connected to the shared zygote of `key` under `anchor`, or None where none
    listens; ZygoteUntrusted where the name's holder does not prove it holds `token`."""
    name = address(key, anchor, token)
    if name in _untrusted:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect("\0" + name)
        if peer_uid(sock) != os.geteuid():  # someone else took the name: not ours
            raise PermissionError("the zygote's name is held by another user")
    except OSError:
        sock.close()
        return None
    try:
        prove_to_zygote(sock, token)  # before a byte or a descriptor of a job passes
    except ZygoteUntrusted:
        sock.close()
        _untrusted.add(name)
        raise
    return _Owner(key[0], dict(key[1]), [], token, sock=sock)  # it greets after its imports


def _current(key: tuple, token: bytes) -> Optional[_Owner]:
    """This worker's owner of `key`'s zygote for `token`'s session, connecting to the shared
    one if need be (called with _lock held)."""
    global _zygote
    owner = _zygote
    if owner is not None and owner.dead is None and owner.key == key and owner.token == token:
        return owner
    named = _attach(key, os.getppid(), token)
    if named is not None:
        if owner is not None:
            owner.close()
        _zygote = named
    return named


def spawn(executable: str, env: Mapping[str, str], channel: int,
          token: bytes) -> Optional[WarmChild]:
    """A rank process forked from the executor's zygote of the same key and session, or None;
    `channel` is the rank end of its channel (the zygote hands it to the rank).  Raises
    ZygoteUntrusted where the zygote's name is held by a process that is not the session's
    zygote, or the zygote went silent: the caller starts fresh, on a fresh channel."""
    with _lock:
        owner = _current(_key(executable, env), token)
    if owner is None:
        return None
    return owner.spawn(env, os.getcwd(), channel)


def learn(executable: str, env: Mapping[str, str], imported: list, token: bytes) -> None:
    """After a rank succeeded: keep a zygote that preloads what it imported (background)."""
    global _zygote
    modules = [m for m in REPORT if m in imported]
    if not any(m in HEAVY for m in modules):
        return
    key = _key(executable, env)
    with _lock:
        try:
            owner = _current(key, token)
        except ZygoteUntrusted as exc:  # its name is taken: the new one stays this worker's
            log.warning("%s; the next zygote is this worker's alone", exc)
            owner = None
        if owner is not None and owner.attached and not owner.ready.is_set():
            return  # another worker's zygote of this key is importing: leave it be
        if owner is not None and set(modules) <= set(owner.modules):
            return
        if owner is not None:  # keep what the last one had, too
            modules = [m for m in REPORT if m in modules or m in owner.modules]
            owner.retire()
        elif _zygote is not None:  # another key's: let go of it (others may use it)
            _zygote.close()
        _zygote = _Owner(executable, env, modules, token,
                         listen=(address(key, os.getppid(), token), os.getppid()))


def shutdown() -> None:
    """Let go of this worker's zygote, asking it to stop listening: it exits at once unless
    another worker holds a connection to it."""
    global _zygote
    with _lock:
        owner, _zygote = _zygote, None
    if owner is not None:
        owner.retire()
