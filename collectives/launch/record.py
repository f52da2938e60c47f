"""What a rank leaves behind: its result, or a failure, and which failure explains a job's.

Terms.  A *result* is what a rank process writes to its store when its
function returns or raises (`RankResult`): the pickled value, or the error
as plain fields (JSON: the task reads it without unpickling anything).  A
*failure* (`Failure`) is one rank's account of why it stopped: its own
exception, a death without a word (a signal, an exit without a result), a
communication error about a peer, or an abort by the launcher.  The *root
cause* of a failed job (`root_cause`) is the failure that explains the others:

1. a rank whose own code raised;
2. a rank that died without a word;
3. a *pointing* error: a communication error naming a peer ("peer rank 1")
   that reported nothing itself; the culprit is that peer, not the reporter;
4. a *partition*: two ranks whose communication errors name each other (both
   alive, both still reaching the launcher): the cause is the link between
   them, so the failure names the pair and no culprit rank;
5. any communication error; then anything else.

Within a class, the earliest arrival wins.  The local launcher, the Spark
driver and the estimator all use this one rule.
"""
from __future__ import annotations

import base64
import dataclasses
import json
import re
import signal
from typing import Any, Collection, Mapping, Optional, Sequence, Tuple

__all__ = ["Failure", "RankResult", "root_cause", "failure_text", "signal_name",
           "COMM_ERRORS", "DEATHS"]

COMM_ERRORS = ("PeerLostError", "CollectiveTimeout",
               "DistBackendError", "DistNetworkError", "DistStoreError")  # torch.distributed's
DEATHS = ("ProcessDied", "ProcessExited", "SparkTaskFailed", "ExecutorLost")
_PEER = re.compile(r"peer rank (\d+)")
_RETURNED = "returned from its function and exited without calling init()"  # mesh.RETURNED
_PEER_AT = re.compile(r"peer rank (\d+) at ([^\s)]+)")
# A communication error a framework re-raised as its own type (TensorFlow turns an error in a
# graph op into UnknownError, keeping the original's "PeerLostError: ..." line in its text), or
# a transport's own words for a peer that went away, in whatever error carries them (torch's
# Gloo raises a RuntimeError out of backward: "gloo/transport/tcp/pair.cc:537] Read error
# [127.0.0.1]:15053: Connection reset by peer"; NCCL's abort after a remote failure).
_WRAPPED_COMM = re.compile(rf"^(?:{'|'.join(COMM_ERRORS)}): |gloo/transport/|"
                           r"Connection (?:closed|reset) by peer|ncclRemoteError|"
                           r"NCCL communicator was aborted", re.MULTILINE)


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


@dataclasses.dataclass(frozen=True)
class Failure:
    """One rank's failure, as every launcher reports it."""
    rank: Optional[int]
    error_type: str = "JobFailed"
    message: str = ""
    size: Optional[int] = None
    host: Optional[str] = None
    exitcode: Optional[int] = None
    traceback: str = ""
    tail: Tuple[str, ...] = ()
    exc_blob: bytes = b""            # the rank's pickled exception, where it could be pickled
    hint: Optional[str] = None
    aborted: bool = False            # the launcher killed it because the job failed elsewhere
    time: float = 0.0
    reported_by: Optional[int] = None  # the rank whose error named this one (a pointing error)

    @property
    def kind(self) -> str:
        """"own", "death", "comm" or "aborted": the classes of the root-cause rule."""
        if self.aborted:
            return "aborted"
        if self.error_type in COMM_ERRORS or _WRAPPED_COMM.search(self.message):
            return "comm"
        if self.error_type in DEATHS:
            return "death"
        return "own"

    def named_peer(self) -> Optional[int]:
        """The peer a communication error names, if it names one."""
        m = _PEER.search(self.message) if self.kind == "comm" else None
        return int(m.group(1)) if m else None

    def to_dict(self) -> dict:
        """A JSON-safe dict (the log channel's and Spark's exception text's form)."""
        out = dataclasses.asdict(self)
        out["tail"] = list(self.tail)
        out["exc_blob"] = base64.b64encode(self.exc_blob).decode() if self.exc_blob else ""
        return out

    @classmethod
    def from_dict(cls, rec: Mapping[str, Any]) -> "Failure":
        """From `to_dict`'s form; unknown keys are ignored, wrong types fall back to defaults."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        values = {k: v for k, v in rec.items() if k in known}
        if "tail" in values:
            values["tail"] = tuple(str(x) for x in (values["tail"] or ()))
        blob = values.pop("exc_blob", "") or ""
        try:
            values["exc_blob"] = base64.b64decode(blob) if isinstance(blob, str) else bytes(blob)
        except (ValueError, TypeError):
            values["exc_blob"] = b""
        for name in ("rank", "size", "exitcode", "reported_by"):
            if values.get(name) is not None and not isinstance(values[name], int):
                values[name] = None
        for name in ("error_type", "message", "traceback"):
            if name in values and not isinstance(values[name], str):
                values[name] = str(values[name])
        return cls(**values)


def root_cause(failures: Sequence[Failure], finished: Collection[int] = ()) -> Failure:
    """The failure that explains the others (see the module docstring); `finished`: the ranks
    known to have returned and exited 0 (a pointing error at one of them says so)."""
    unique, seen = [], set()
    for f in failures:
        if f.rank is None or f.rank not in seen:
            seen.add(f.rank)
            unique.append(f)
    if not unique:
        raise ValueError("root_cause needs at least one failure")
    for kind in ("own", "death"):
        found = [f for f in unique if f.kind == kind]
        if found:
            return found[0]
    spoke = {f.rank for f in unique if f.kind != "aborted"}  # the aborted said nothing themselves
    for f in unique:
        peer = f.named_peer()
        if f.kind == "comm" and peer is not None and peer not in spoke:
            returned = peer in finished or _RETURNED in f.message
            return dataclasses.replace(
                f, rank=peer, host=None, exitcode=0 if returned else None, reported_by=f.rank,
                hint=(f"rank {peer} returned from its function and exited 0 while rank {f.rank} "
                      f"waited for it: every rank must call init() and the same collectives, "
                      f"the same number of times" if returned else
                      f"rank {peer} reported nothing itself: is it stopped, swapped out or cut "
                      f"off? (rank {f.rank} saw it)"))
    pair = _partition(unique)
    if pair is not None:
        return pair
    order = {"comm": 0, "death": 1, "own": 1, "aborted": 2}
    return min(enumerate(unique), key=lambda i_f: (order[i_f[1].kind], i_f[0]))[1]


def _where(rank: int, own: Failure, other: Failure) -> str:
    """Where a rank is: its own host, or the address its peer's error gives it."""
    for m in _PEER_AT.finditer(other.message):
        if int(m.group(1)) == rank:
            return m.group(2)
    return own.host or "an unknown address"


def _partition(unique: Sequence[Failure]) -> Optional[Failure]:
    """The earliest two communication errors that name each other, as one failure of the
    link between their ranks (rank None: neither rank is the culprit)."""
    comm = {f.rank: f for f in unique if f.kind == "comm" and f.rank is not None}
    for f in comm.values():
        g = comm.get(f.named_peer())
        if g is None or g is f or g.named_peer() != f.rank:
            continue
        a, b = _where(f.rank, f, g), _where(g.rank, g, f)
        if a.rsplit(":", 1)[0] == b.rsplit(":", 1)[0]:
            continue  # one host: ranks waiting on each other are not cut off from each other
        return dataclasses.replace(
            f, rank=None, host=None, exitcode=None, reported_by=None,
            message=f"rank {f.rank} at {a} and rank {g.rank} at {b} cannot reach each other, "
                    f"each waited on the other (rank {f.rank}: {f.message} | rank {g.rank}: "
                    f"{g.message})",
            hint=f"a network partition between {a} and {b}? both still reach the driver; "
                 f"check the routes and firewalls between those hosts")
    return None


@dataclasses.dataclass(frozen=True)
class RankResult:
    """What a rank process writes to its store: the pickled value, or a failure.

    Encoded as one line "ok" or "error", then the pickled value or the
    failure's JSON, so a reader learns which without unpickling.
    """
    value_blob: bytes = b""
    failure: Optional[Failure] = None

    @property
    def ok(self) -> bool:
        return self.failure is None

    def encode(self) -> bytes:
        if self.failure is None:
            return b"ok\n" + self.value_blob
        return b"error\n" + json.dumps(self.failure.to_dict()).encode()

    @classmethod
    def decode(cls, data: bytes) -> "RankResult":
        head, _, body = data.partition(b"\n")
        if head == b"ok":
            return cls(value_blob=body)
        if head == b"error":
            try:
                rec = json.loads(body)
            except ValueError:
                rec = None
            if isinstance(rec, dict):
                return cls(failure=Failure.from_dict(rec))
        return cls(failure=Failure(None, "CorruptResult", f"a rank's result record does not "
                                                          f"parse (starts {data[:16]!r})"))

    def value(self) -> Any:
        """The function's return value (unpickled: call only on results from our own rank)."""
        import cloudpickle

        return cloudpickle.loads(self.value_blob)
