"""A group of rank processes: output pumps, failure detection, cleanup.

The *root cause* of a failed job is chosen after a short grace period, so a
rank that raised or died is named rather than the peers that merely lost it:
first a rank whose own code raised, then a rank that died without a word
(signal, os._exit), then the earliest communication error.  Once a rank has
returned, the others have a *finish grace* to return too; a rank still running
after it (frozen, or running steps the others do not) fails the job by name.
"""
from __future__ import annotations

import collections
import os
import re
import signal
import threading
import time
from typing import Optional

import cloudpickle

from .. import settings

__all__ = ["RankFailed", "RankGroup", "failure_text", "signal_name", "finish_grace",
           "unfinished_text", "FINISH_GRACE"]

_COMM_ERRORS = ("PeerLostError", "CollectiveTimeout")
_PEER = re.compile(r"peer rank (\d+)")
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


def signal_name(exitcode: Optional[int]) -> Optional[str]:
    """The name of the signal a negative exit code stands for (SIGKILL), else None."""
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return str(-exitcode)


def failure_text(headline: str, who: str, remote_traceback: str, output_tail: str) -> str:
    """A failed rank's message: the headline, then its traceback and last output, each titled."""
    text = headline
    if remote_traceback:
        text += f"\n--- traceback of {who} ---\n{remote_traceback.rstrip()}"
    if output_tail:
        text += f"\n--- last output of {who} ---\n{output_tail.rstrip()}"
    return text


class RankFailed(RuntimeError):
    """A rank raised, exited non-zero or died; carries its remote traceback and output."""

    def __init__(self, rank: Optional[int], exitcode: Optional[int], error_type: str, message: str,
                 remote_traceback: str = "", output_tail: str = "", exc_blob: bytes = b"") -> None:
        self.rank, self.exitcode = rank, exitcode
        self.error_type, self.message = error_type, message
        self.remote_traceback, self.output_tail, self.exc_blob = remote_traceback, output_tail, exc_blob
        super().__init__(self._text())

    def _text(self) -> str:
        who = "job" if self.rank is None else f"rank {self.rank}"
        killer = signal_name(self.exitcode)
        status = f" (killed by {killer})" if killer else ""
        if self.exitcode and not killer:
            status = f" (exit status {self.exitcode})"
        return failure_text(f"{who} failed{status}: {self.error_type}: {self.message}", who,
                            self.remote_traceback, self.output_tail)

    def original(self) -> Optional[BaseException]:
        """The rank's own exception object, where it could be pickled."""
        try:
            return cloudpickle.loads(self.exc_blob) if self.exc_blob else None
        except Exception:
            return None


def _pump(pipe, rank: int, label: str, sink, tail) -> None:
    for raw in iter(pipe.readline, b""):
        line = raw.decode("utf-8", "replace")
        tail.append(f"{label}: {line.rstrip()}")
        if sink is None:
            continue
        try:  # a broken log channel never fails the job
            sink.write(f"[{rank}]<{label}>:{line}" if sink.prefix else line)
            sink.flush()
        except Exception:
            pass
    pipe.close()


class _Sink:
    def __init__(self, stream, prefix: bool) -> None:
        self.stream, self.prefix = stream, prefix

    def write(self, text):
        self.stream.write(text)

    def flush(self):
        self.stream.flush()


class RankGroup:
    def __init__(self, procs, store, job: str, stdout, stderr, prefix_output: bool = True) -> None:
        self.procs, self.store, self.job = procs, store, job
        self.tails = [collections.deque(maxlen=TAIL) for _ in procs]
        self._pumps = []
        for r, p in enumerate(procs):
            for pipe, label, stream in ((p.stdout, "stdout", stdout), (p.stderr, "stderr", stderr)):
                t = threading.Thread(target=_pump, daemon=True,
                                     args=(pipe, r, label, _Sink(stream, prefix_output), self.tails[r]))
                t.start()
                self._pumps.append(t)

    def _record(self, rank: int):
        key = f"{self.job}/result/{rank}"
        return cloudpickle.loads(self.store.get(key)) if self.store.check(key) else None

    def _failure(self, rank: int) -> RankFailed:
        rc = self.procs[rank].returncode
        rec = self._record(rank)
        tail = "\n".join(self.tails[rank])
        if rec and rec[0] == "error":
            blob = rec[4] if len(rec) > 4 else b""
            return RankFailed(rank, rc, rec[1], rec[2], rec[3], tail, blob)
        if rc is not None and rc < 0:
            return RankFailed(rank, rc, "ProcessDied", "the rank process died by a signal", "", tail)
        return RankFailed(rank, rc, "ProcessExited",
                          "the rank process exited without returning a result", "", tail)

    def _root_cause(self, failed: list) -> RankFailed:
        errs = [self._failure(r) for r in failed]
        own = [e for e in errs if e.error_type not in _COMM_ERRORS + ("ProcessDied", "ProcessExited")]
        silent = [e for e in errs if e.error_type in ("ProcessDied", "ProcessExited")]
        # A communication error that names a peer which reported nothing itself points at
        # the culprit (a stalled rank); one naming another victim only repeats the news.
        pointing = [e for e in errs if e.error_type in _COMM_ERRORS
                    and (m := _PEER.search(e.message)) and int(m.group(1)) not in failed]
        return (own or silent or pointing or errs)[0]

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
                raise RankFailed(running[0], None, "RankDidNotFinish",
                                 unfinished_text(first_ok[1], running, grace))
            if deadline is not None and time.monotonic() > deadline:
                running = [r for r, c in enumerate(codes) if c is None]
                raise RankFailed(None, None, "JobTimeout",
                                 f"ranks {running} still running after {timeout:g} s; killed")
            time.sleep(0.005)

    def wait_results(self, timeout: Optional[float] = None, grace: float = FINISH_GRACE) -> list:
        self.wait_exit(timeout, grace)
        out = []
        for r in range(len(self.procs)):
            rec = self._record(r)
            if rec is None or rec[0] != "ok":
                raise self._failure(r)
            out.append(rec[1])
        return out

    def kill(self) -> None:
        """SIGTERM every rank's process group, then SIGKILL what is left."""
        live = [p for p in self.procs if p.poll() is None]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in live:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            end = time.monotonic() + 1.0
            while time.monotonic() < end and any(p.poll() is None for p in live):
                time.sleep(0.01)
        for p in self.procs:
            try:  # grandchildren left in a rank's session
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            p.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()
        for t in self._pumps:
            t.join(timeout=2.0)
        self.store.close()
