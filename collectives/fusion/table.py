"""The message table: announced signatures waiting for the other ranks.

A request whose signature is not in the response cache is *announced*: its
signature goes, once, to every rank in a negotiation round.  Every rank keeps
the same table of announcements (it is built from the same gathered data in
rank order), so every rank reaches the same outcome for a name in the same
cycle, with no coordinator:

* *ready*: every rank that has not joined has announced it, all with one
  signature;
* *mismatch*: two ranks announced different signatures.  Every rank that
  announced it gets the error now; the name stays *poisoned* so that a rank
  announcing it later gets the same error at once instead of waiting forever.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Set, Tuple

from .request import Signature

__all__ = ["MessageTable"]


class MessageTable:
    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: Dict[str, Dict[int, Signature]] = {}
        self._poison: Dict[str, Tuple[str, Set[int]]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def add(self, rank: int, sig: Signature) -> Optional[str]:
        """Record rank's announcement; returns the error text if the name is poisoned."""
        poisoned = self._poison.get(sig.name)
        if poisoned is not None:
            text, told = poisoned
            told.add(rank)
            if len(told) >= self.size:
                del self._poison[sig.name]
            return text
        self._entries.setdefault(sig.name, {})[rank] = sig
        return None

    def drop(self, name: str) -> None:
        self._entries.pop(name, None)

    def resolve(self, joined: Sequence[bool]) -> Tuple[List[Signature], List[Tuple[str, str, List[int]]]]:
        """(ready signatures in announcement order, [(name, error text, ranks told)])."""
        ready: List[Signature] = []
        errors: List[Tuple[str, str, List[int]]] = []
        active = [r for r in range(self.size) if not joined[r]]
        for name in list(self._entries):
            by_rank = self._entries[name]
            sigs = set(by_rank.values())
            if len(sigs) > 1:
                text = _mismatch_text(name, by_rank)
                ranks = sorted(by_rank)
                errors.append((name, text, ranks))
                told = set(ranks) | {r for r in range(self.size) if joined[r]}
                if len(told) < self.size:
                    self._poison[name] = (text, told)
                del self._entries[name]
            elif all(r in by_rank for r in active):
                ready.append(next(iter(sigs)))
                del self._entries[name]
        return ready, errors


def _mismatch_text(name: str, by_rank: Dict[int, Signature]) -> str:
    groups: Dict[Signature, List[int]] = {}
    for r in sorted(by_rank):
        groups.setdefault(by_rank[r], []).append(r)
    parts = "; ".join(f"{_ranks(rs)}: {sig.brief()}" for sig, rs in groups.items())
    return f"ranks disagree on tensor '{name}' ({parts})"


def _ranks(rs: List[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ",".join(str(r) for r in rs)
