"""Failure records in a task's exception text: how the driver names a failed rank when the
log channel could not carry the record (no channel to this client, or a channel cut).

A *marker* is one line, `HVS-FAILURE:` and the base64 of a failure record's JSON.  A task
that fails raises `marked_failure`: its text carries the record twice, a compact marker
right after the headline (`compact_record`: what fits in the first 2 KB, all a Spark
Connect client before 4.0 receives) and the whole record at the end.  The driver takes
the fullest of them (`parse_failure_markers`); a pickled exception never travels here,
only on the authenticated log channel.
"""
from __future__ import annotations

import base64
import json
import re

from collectives.launch import RankFailed
from collectives.launch.record import Failure

__all__ = ["failure_marker", "failure_markers", "marked_failure", "compact_record",
           "parse_failure_markers", "COMPACT_JSON"]

_MARKER = "HVS-FAILURE:"
_MARKER_RE = re.compile(re.escape(_MARKER) + r"([A-Za-z0-9+/=]+)")


def failure_marker(record: dict) -> str:
    """One line that carries a failure record through Spark's exception text."""
    blob = json.dumps(record, separators=(",", ":")).encode()
    return _MARKER + base64.b64encode(blob).decode()


# What a Spark Connect client before 4.0 receives of an exception's text: its first 2 KB (it
# cannot fetch the rest).  Before the task's exception come Spark's headline and the Python
# worker's frames (about 900 characters with a site-packages install's paths), then the
# exception's headline (at most procs.EARLY_AFTER); the compact marker fits in what is left.
COMPACT_JSON = 560


def compact_record(record: dict, budget: int = COMPACT_JSON) -> dict:
    """The record cut to `budget` bytes of JSON: the error's type and message, the
    traceback's last lines and the output's last lines, shortened in that order of
    importance (the hint first, the message last) until it fits."""
    out = {k: v for k, v in record.items() if k not in ("exc_blob", "traceback", "tail")}
    tb = (record.get("traceback") or "").rstrip().splitlines()
    frames = max((i for i, line in enumerate(tb) if line.startswith(" ")), default=-1)
    tb = tb[:frames + 1] or tb  # the frames' last lines; the error's line is the message
    tail = [str(line) for line in list(record.get("tail") or ())]
    message, hint = str(out.get("message") or ""), out.get("hint")
    steps = [  # (hint, traceback lines and chars, tail lines and chars, message chars)
        (160, 3, 360, 2, 120, 300), (80, 2, 240, 2, 100, 240), (0, 2, 200, 1, 100, 200),
        (0, 1, 160, 1, 80, 160), (0, 1, 120, 1, 60, 100), (0, 1, 80, 0, 0, 60)]
    for hint_n, tb_lines, tb_n, tail_lines, tail_n, msg_n in steps:
        if isinstance(hint, str):
            out["hint"] = hint[:hint_n] + "..." if len(hint) > hint_n else hint
            if not hint_n:
                out.pop("hint")
        out["message"] = message[:msg_n] + "..." if len(message) > msg_n else message
        if tb:
            out["traceback"] = "\n".join(tb[-tb_lines:])[-tb_n:]
        out["tail"] = [line[-tail_n:] for line in tail[-tail_lines:]] if tail_lines else []
        if len(json.dumps(out, separators=(",", ":"))) <= budget:
            break
    return out


def failure_markers(record: dict) -> "tuple[str, str]":
    """The record as two markers: a compact one (see compact_record), to be placed early in
    the exception's text (RankFailed's `early`), and the whole, at its end."""
    return failure_marker(compact_record(record)), failure_marker(record)


def marked_failure(failure: Failure) -> RankFailed:
    """What a task raises for its rank's failure: the failure's text, with the record as a
    compact marker after its headline and whole at its end (the pickled exception stays
    off: it is only ever taken from the authenticated log channel)."""
    record = failure.to_dict()
    record.pop("exc_blob", None)
    compact, whole = failure_markers(record)
    return RankFailed(failure, whole, early=compact)


def parse_failure_markers(text: str) -> list:
    """Every failure record found in `text` (a Spark exception message), in order; of the
    records of one failure (compact and whole, see failure_markers) the fullest that arrived."""
    out, seen = [], {}
    for m in _MARKER_RE.finditer(text or ""):
        try:
            rec = json.loads(base64.b64decode(m.group(1)))
        except ValueError:  # cut short: a client that received only the text's start
            continue
        if not isinstance(rec, dict):
            continue
        # The text carries the rank's own traceback, which anyone's message can forge:
        # a pickled exception is only ever taken from the authenticated log channel.
        rec.pop("exc_blob", None)
        key, size = (rec.get("rank"), rec.get("time"), rec.get("type")), len(m.group(1))
        if key in seen:
            at, before = seen[key]
            if size > before:
                out[at], seen[key] = rec, (at, size)
            continue
        seen[key] = (len(out), size)
        out.append(rec)
    return out
