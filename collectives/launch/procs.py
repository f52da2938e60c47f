"""A group of rank processes: output pumps, failure detection, cleanup.

The root cause of a failed job is chosen after a short grace period, by the
one rule of `record.root_cause`, so a rank that raised or died is named
rather than the peers that merely lost it.  Once a rank has returned, the
others have a *finish grace* to return too; a rank still running after it
(frozen, or running steps the others do not) fails the job by name.
"""
from __future__ import annotations

import collections
import ctypes
import dataclasses
import os
import signal
import sys
import threading
import time
from typing import Optional

import cloudpickle

from .. import settings
from ..backends.shm_names import remove_segments_of
from .record import Failure, RankResult, failure_text, root_cause, signal_name

__all__ = ["RankFailed", "RankGroup", "die_with_parent", "kept", "stop_kept", "pump", "finish_grace",
           "unfinished_text", "FINISH_GRACE"]

GRACE = 1.0
TAIL = 20
#: Seconds the other ranks may run on once one rank returned (HOROVOD_SPARK_FINISH_GRACE_SECONDS).
FINISH_GRACE = settings.FINISH_GRACE.default


def finish_grace(env=None) -> float:
    """The finish grace: the job's `env` wins over this process's environment; 0: for ever."""
    job = dict(env or {})
    return settings.FINISH_GRACE.read(job if job.get(settings.FINISH_GRACE.name) else None)


def unfinished_text(returned: int, running: list, grace: float) -> str:
    """What a job whose ranks did not all return within the finish grace is told."""
    who = f"rank {running[0]} has" if len(running) == 1 else f"ranks {running} have"
    return (f"rank {returned} returned from the function {grace:g} s ago and {who} not: a rank "
            "frozen, or running steps the others do not; every rank must run the same number "
            "of steps, or use hvd.join() (HOROVOD_SPARK_FINISH_GRACE_SECONDS sets this grace; "
            "0 waits for ever)")


PR_SET_PDEATHSIG = 1

try:
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork, not in the child
except (OSError, AttributeError):  # not Linux
    _PRCTL = None


def die_with_parent() -> None:
    """PR_SET_PDEATHSIG(SIGKILL): this process dies with the thread that forked it (a
    preexec_fn, or a forked child's first call; nothing where prctl is missing)."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL)


#: The keeper (see keeper.py), run by path so that it needs no site-packages.
KEEPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "keeper.py")
#: Seconds a keeper told to stop may take before its process group is SIGKILLed.
STOP_GRACE_S = 3.0


def kept(cmd) -> list:
    """`cmd` started under a keeper (see keeper.py): it dies with this process, and nothing
    it starts outlives it.  Run without a preexec_fn: one makes subprocess fork() where it
    would vfork(), which runs the parent's pthread_atfork handlers in the child (gRPC's,
    under a Spark Connect session's client, abort some children before they exec)."""
    return [sys.executable, "-S", KEEPER, str(os.getpid()), *cmd]


def stop_kept(procs, grace: float = STOP_GRACE_S) -> None:
    """Stop the kept ranks `procs` (each has .pid, the keeper's, and .poll()): SIGTERM to
    each keeper, which kills its rank and what the rank left; then, for a keeper still
    there after `grace` seconds, SIGKILL to its process group."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        try:
            os.kill(p.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    end = time.monotonic() + grace
    while time.monotonic() < end and any(p.poll() is None for p in live):
        time.sleep(0.005)
    for p in procs:
        try:  # a keeper that did not stop; what is left in a rank's session
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def pump(pipe, on_line, lines=None) -> None:
    """Hand every line of a child's output pipe (decoded) to `on_line` until the child
    closes it; then close the pipe.  lines(pipe): how the pipe is cut into lines (default:
    at newlines, newline kept)."""
    for raw in (lines or _readlines)(pipe):
        on_line(raw.decode("utf-8", "replace"))
    pipe.close()


def _readlines(pipe):
    return iter(pipe.readline, b"")


EARLY_AFTER = 240  # RankFailed's early line follows a headline up to this long, else leads


class RankFailed(RuntimeError):
    """A rank raised, exited non-zero or died: its `Failure`, with traceback and output."""

    def __init__(self, failure: Failure, extra: str = "", early: str = "") -> None:
        """extra: a line after the text; early: one that must come within the text's first
        few hundred characters (after a short headline, else first), for a reader that
        receives only the text's start."""
        self.failure = failure
        text = self._text()
        if early:
            head, sep, rest = text.partition("\n")
            text = (f"{head}\n{early}{sep}{rest}" if len(head) <= EARLY_AFTER
                    else f"{early}\n{text}")
        super().__init__(text + (f"\n{extra}" if extra else ""))

    def __reduce__(self):
        return (type(self), (self.failure,))

    rank = property(lambda self: self.failure.rank)
    exitcode = property(lambda self: self.failure.exitcode)
    error_type = property(lambda self: self.failure.error_type)
    message = property(lambda self: self.failure.message)
    remote_traceback = property(lambda self: self.failure.traceback)
    output_tail = property(lambda self: "\n".join(self.failure.tail))
    exc_blob = property(lambda self: self.failure.exc_blob)

    def _who(self) -> str:
        f = self.failure
        who = "job" if f.rank is None else f"rank {f.rank}"
        return who if f.reported_by is None else f"rank {f.reported_by} (which named rank {f.rank})"

    def _text(self) -> str:
        f = self.failure
        who = "job" if f.rank is None else f"rank {f.rank}"
        killer = signal_name(f.exitcode)
        status = f" (killed by {killer})" if killer else ""
        if f.exitcode and not killer:
            status = f" (exit status {f.exitcode})"
        if f.reported_by is not None:
            status = f" (as rank {f.reported_by} reports)"
        hint = f"; {f.hint}" if f.hint else ""
        return failure_text(f"{who} failed{status}: {f.error_type}: {f.message}{hint}",
                            self._who(), f.traceback, "\n".join(f.tail))

    def original(self) -> Optional[BaseException]:
        """The rank's own exception object, where it could be pickled."""
        try:
            return cloudpickle.loads(self.exc_blob) if self.exc_blob else None
        except Exception:
            return None


def _forward(rank: int, label: str, sink, tail):
    """The pump's callback for one rank's stream: keep the tail, write to the sink."""
    def on_line(line: str) -> None:
        tail.append(f"{label}: {line.rstrip()}")
        try:  # a broken log channel never fails the job
            sink.write(f"[{rank}]<{label}>:{line}" if sink.prefix else line)
            sink.flush()
        except Exception:
            pass
    return on_line


class _Sink:
    def __init__(self, stream, prefix: bool) -> None:
        self.stream, self.prefix = stream, prefix

    def write(self, text):
        self.stream.write(text)

    def flush(self):
        self.stream.flush()


class RankGroup:
    """Kept rank processes (see `kept`), each with its channel (`channel.LauncherEnd`)."""

    def __init__(self, procs, store, job: str, stdout, stderr, prefix_output: bool = True,
                 channels=(), held=()) -> None:
        self.procs, self.store, self.job = procs, store, job
        self.channels, self.held = list(channels), list(held)  # held: closed with the group
        self.tails = [collections.deque(maxlen=TAIL) for _ in procs]
        self._pumps = []
        for r, p in enumerate(procs):
            for pipe, label, stream in ((p.stdout, "stdout", stdout), (p.stderr, "stderr", stderr)):
                on_line = _forward(r, label, _Sink(stream, prefix_output), self.tails[r])
                t = threading.Thread(target=pump, args=(pipe, on_line), daemon=True)
                t.start()
                self._pumps.append(t)

    def _result(self, rank: int) -> Optional[RankResult]:
        """What the rank said on its own channel, once its process has ended (nothing else
        can write there: a result planted in the store is never read)."""
        if not self.channels or self.procs[rank].poll() is None:
            return None
        channel = self.channels[rank]
        channel.finish()
        return RankResult.decode(channel.result) if channel.result is not None else None

    def _failure(self, rank: int) -> Failure:
        rc = self.procs[rank].returncode
        res = self._result(rank)
        tail = tuple(self.tails[rank])
        if res is not None and not res.ok:
            return dataclasses.replace(res.failure, rank=rank, exitcode=rc, tail=tail)
        if rc is not None and rc < 0:
            return Failure(rank, "ProcessDied", "the rank process died by a signal", exitcode=rc,
                           tail=tail)
        return Failure(rank, "ProcessExited", "the rank process exited without returning a result",
                       exitcode=rc, tail=tail)

    def _root_cause(self, failed: list) -> RankFailed:
        finished = [r for r, p in enumerate(self.procs) if p.returncode == 0]
        return RankFailed(root_cause([self._failure(r) for r in failed], finished))

    def wait_exit(self, timeout: Optional[float] = None, grace: float = FINISH_GRACE) -> None:
        """Wait for every rank to exit 0; raise RankFailed for the root cause otherwise.

        grace: the finish grace (see the module docstring); 0 waits for ever."""
        deadline = None if timeout is None else time.monotonic() + timeout
        first_fail = first_ok = None
        while True:
            codes = [p.poll() for p in self.procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed and first_fail is None:
                first_fail = time.monotonic()
            if failed and (all(c is not None for c in codes) or time.monotonic() - first_fail > GRACE):
                raise self._root_cause(failed)
            if not failed and all(c == 0 for c in codes):
                return
            if first_ok is None and 0 in codes:
                first_ok = (time.monotonic(), codes.index(0))
            if not failed and first_ok and grace > 0 and time.monotonic() - first_ok[0] > grace:
                running = [r for r, c in enumerate(codes) if c is None]
                raise RankFailed(Failure(running[0], "RankDidNotFinish",
                                         unfinished_text(first_ok[1], running, grace)))
            if deadline is not None and time.monotonic() > deadline:
                running = [r for r, c in enumerate(codes) if c is None]
                raise RankFailed(Failure(None, "JobTimeout",
                                         f"ranks {running} still running after {timeout:g} s; killed"))
            time.sleep(0.005)

    def wait_results(self, timeout: Optional[float] = None, grace: float = FINISH_GRACE) -> list:
        """Every rank's value, in rank order, once every rank exited 0 with a result."""
        self.wait_exit(timeout, grace)
        out = []
        for r in range(len(self.procs)):
            res = self._result(r)
            if res is None or not res.ok:
                raise RankFailed(self._failure(r))
            out.append(res)
        return [loaded(r, res) for r, res in enumerate(out)]

    def kill(self) -> None:
        """Stop every rank and what it left (see `stop_kept`); reap the keepers."""
        stop_kept(self.procs)
        for p in self.procs:
            p.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()
        for p in self.procs:  # what a rank killed between creating and sharing it left
            remove_segments_of(p.pid)
        for closeable in (*self.channels, *self.held):
            closeable.close()
        for t in self._pumps:
            t.join(timeout=2.0)
        self.store.close()


def loaded(rank: int, result: RankResult):
    """A rank's value, unpickled here; RankFailed naming the rank where it cannot be."""
    try:
        return result.value()
    except Exception as exc:
        missing = isinstance(exc, ImportError) or "No module named" in str(exc)
        hint = ("a module the value's classes live in is missing here (installed on the "
                "ranks' machines only, or another version): install it where the job was "
                "started, or return plain types (numbers, lists, numpy arrays, a state_dict, "
                "a path)") if missing else (
                "the value pickled on the rank but does not load here (another version of "
                "a library?); return plain types (numbers, lists, numpy arrays, a path)")
        raise RankFailed(Failure(rank, "ResultNotLoadable",
                                 f"the return value of rank {rank} cannot be loaded where the "
                                 f"job was started: {type(exc).__name__}: {exc}",
                                 hint=hint)) from None
