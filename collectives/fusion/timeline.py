"""The timeline: a Chrome-trace JSON file of every tensor's phases.

Written by rank 0 only (as Horovod does), to `Config.timeline`
(HOROVOD_TIMELINE).  Each tensor gets its own row (a `tid` named after the
tensor); each phase is a complete event ("ph": "X") with microsecond
timestamps from the engine's start:

    NEGOTIATE                 submitted -> every rank agreed it is ready
    QUEUE                     agreed -> its fused collective starts
    MEMCPY_IN_FUSION_BUFFER   packing into the fusion buffer (the "pack" phase)
    ALLREDUCE (or the kind)   the collective itself
    MEMCPY_OUT_FUSION_BUFFER  unpacking out of it (the "unpack" phase)

The file is the JSON array format: "[" then one event per line.  It is
flushed every half second by a writer thread, so the engine thread only
appends tuples, and closed with "]" at shutdown, after which it is valid JSON
(chrome://tracing and Perfetto also open the unclosed file of a crashed run).
"""
from __future__ import annotations

import json
import threading
import time
from typing import Dict, List, Optional

__all__ = ["Timeline"]

_FLUSH_S = 0.5


class Timeline:
    def __init__(self, path: str, rank: int, t0: Optional[float] = None) -> None:
        self.path, self.rank = path, rank
        self._t0 = time.perf_counter() if t0 is None else t0
        self._events: List[tuple] = []
        self._tids: Dict[str, int] = {}
        self._file = open(path, "w", encoding="utf-8")
        self._file.write("[\n")
        self._first = True
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._emit({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                    "args": {"name": f"rank {rank}"}})
        self._writer = threading.Thread(target=self._loop, name="fusion-timeline", daemon=True)
        self._writer.start()

    def span(self, tensor: str, phase: str, start: float, end: float, args: Optional[dict] = None) -> None:
        """Record one phase of one tensor (perf_counter seconds); cheap, any thread."""
        self._events.append((tensor, phase, start, end, args))

    def mark(self, name: str, when: float) -> None:
        """An instant event on the engine's own row (e.g. a cycle start)."""
        self._events.append((None, name, when, when, None))

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._writer.join(timeout=5.0)
        with self._lock:
            self._flush()
            self._file.write("\n]\n")
            self._file.close()

    def _loop(self) -> None:
        while not self._stop.wait(_FLUSH_S):
            with self._lock:
                if not self._file.closed:
                    self._flush()

    def _flush(self) -> None:
        events, self._events = self._events, []
        for tensor, phase, start, end, args in events:
            tid = 0 if tensor is None else self._tid(tensor)
            ev = {"name": phase, "ph": "X" if end > start or tensor else "i", "pid": self.rank,
                  "tid": tid, "ts": round((start - self._t0) * 1e6, 3)}
            if ev["ph"] == "X":
                ev["dur"] = round((end - start) * 1e6, 3)
            else:
                ev["s"] = "t"
            if args:
                ev["args"] = args
            self._emit(ev)
        self._file.flush()

    def _tid(self, tensor: str) -> int:
        tid = self._tids.get(tensor)
        if tid is None:
            tid = self._tids[tensor] = len(self._tids) + 1
            self._emit({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                        "args": {"name": tensor}})
        return tid

    def _emit(self, event: dict) -> None:
        self._file.write(("" if self._first else ",\n") + json.dumps(event, separators=(",", ":")))
        self._first = False
