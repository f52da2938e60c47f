"""Stall inspection: tensors that some ranks submitted and others have not, for too long.

Each rank probes its own pending table at most every half stall-check time;
a rank whose oldest request is older than `stall_check_time` (and that has
not seen a report for that long) raises the stall flag of the coordination
vector.  Then every rank, in the same cycle, gathers every rank's pending
names with their ages, and each rank that holds a stalled tensor logs a
warning naming it, the ranks that have not submitted it and what those ranks
wait in instead (a name submitted as another kind, or another name, shows up
there).  Once a report's oldest stalled tensor is past `stall_shutdown_time`
(default 300 s; 0: never), every stalled tensor of that report fails on the
ranks that hold it with CollectiveTimeout, and every rank drops them: the
report is the same on every rank, so every rank decides alike.  A stall is a
hang, so the default fails it rather than waits.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Dict

from ..errors import CollectiveTimeout, describe
from . import coordinator as C

__all__ = ["StallWatch"]

log = logging.getLogger("collectives.fusion")
_HINT = "a rank skipped this op or runs fewer steps; hvd.join() ends uneven loops"
_SHUTDOWN_HINT = ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS was reached; every rank must submit the same "
                  "names with the same kinds; set it higher where one rank works alone longer, "
                  "or 0 to wait for ever")
#: Pending ops of a missing rank named in a report.
_SHOWN = 3


class StallWatch:
    def __init__(self, comm, config, rank: int, size: int) -> None:
        self._comm, self._config, self.rank, self.size = comm, config, rank, size
        self._next_probe = self._last_report = time.perf_counter()

    def due(self, pending: dict) -> bool:
        """Whether this rank should raise the stall flag this cycle."""
        limit = self._config.stall_check_time
        if limit <= 0 or self._config.stall_check_disable or not pending:
            return False
        now = time.perf_counter()
        if now < self._next_probe:
            return False
        self._next_probe = now + min(1.0, limit / 2)
        oldest = min(req.t_submit for req in pending.values())
        return now - oldest >= limit and now - self._last_report >= limit

    def report(self, pending: dict, joined: tuple, table, done: Callable) -> None:
        """Collective: every rank calls it in the cycle whose vector had the stall flag."""
        now = self._last_report = time.perf_counter()
        mine = [[req.name, req.sig.tensor(), req.sig.kind, now - req.t_submit]
                for req in pending.values()]
        holders: Dict[str, dict] = {}
        for r, items in enumerate(C.gather_json(self._comm, mine, "fusion.stall")):
            for name, tensor, kind, age in items:
                holders.setdefault(name, {})[r] = (tensor, kind, age)
        stalled = []
        for name, by_rank in holders.items():
            age = max(v[2] for v in by_rank.values())
            missing = [r for r in range(self.size) if r not in by_rank and not joined[r]]
            if missing and age >= self._config.stall_check_time:
                stalled.append((name, by_rank, missing, age))
        # One decision for the whole report, so ranks stalled on different names (one name
        # submitted as two kinds) all fail in this cycle, none of them later by a lost peer.
        limit = self._config.stall_shutdown_time
        fail = limit > 0 and any(age >= limit for *_, age in stalled)
        for name, by_rank, missing, age in stalled:
            text = (f"stalled for {age:.1f} s: submitted by ranks {sorted(by_rank)}, "
                    f"not yet by ranks {missing}; " + _instead(missing, holders))
            self._stalled(name, by_rank, text, fail, pending, table, done)

    def _stalled(self, name, by_rank, text, fail, pending, table, done) -> None:
        tensor, kind, _ = next(iter(by_rank.values()))
        where = dict(rank=self.rank, size=self.size, op=kind, tensor=tensor)
        if self.rank in by_rank:
            log.warning(describe(text, hint=_HINT, **where))
        if fail:
            table.drop(name)
            req = pending.pop(name, None)
            if req is not None:
                done(req, None, CollectiveTimeout(describe(
                    text, timeout=self._config.stall_shutdown_time, hint=_SHUTDOWN_HINT,
                    **where)))


def _instead(missing: list, holders: Dict[str, dict]) -> str:
    """What the missing ranks wait in instead, oldest first: the clue to a name or kind
    that differs between ranks."""
    parts = []
    for r in missing:
        theirs = sorted(((by_rank[r][2], by_rank[r][1], by_rank[r][0])
                         for by_rank in holders.values() if r in by_rank), reverse=True)
        if not theirs:
            parts.append(f"rank {r} has submitted nothing (is it outside the training loop, or "
                         "has it returned?)")
            continue
        shown = ", ".join(f"{kind} {tensor}" for _, kind, tensor in theirs[:_SHOWN])
        more = f" and {len(theirs) - _SHOWN} more" if len(theirs) > _SHOWN else ""
        parts.append(f"rank {r} waits in {shown}{more}")
    return "; ".join(parts)
