"""The response cache: a bit per signature every rank has agreed on before.

Horovod's fast path.  Once the ranks have negotiated a signature, it gets a
*bit*: a slot in the coordination vector that every rank sets when it has a
request with that exact signature pending.  The cache is changed only by
negotiated outcomes, which every rank computes from the same data in the same
order, so the caches (and the vector layout) are identical on every rank
without ever being sent.

One name has at most one entry: a new signature for a known name (a shape
that changed, say) evicts the old entry; the freed bit is reused lowest
first, so slots stay deterministic.  At `capacity` entries (Horovod's
HOROVOD_CACHE_CAPACITY default, 1024) the least recently *used* entry (used:
agreed ready in a cycle, which every rank sees alike) makes room, so unique
names (barriers, unnamed ops) never grow the coordination vector without
bound.  A rank whose pending request loses its entry simply announces it
again in the next cycle.
"""
from __future__ import annotations

import collections
import heapq
from typing import Dict, List, Optional

from .request import Signature

__all__ = ["ResponseCache"]


class ResponseCache:
    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._bit: "collections.OrderedDict[Signature, int]" = collections.OrderedDict()
        self._by_name: Dict[str, Signature] = {}
        self._slots: List[Optional[Signature]] = []
        self._free: List[int] = []
        self.version = 0  # counts changes
        self._changed: set = set()  # bits freed or reassigned since take_changed() (the lane's)

    def __len__(self) -> int:
        """Number of bits in the coordination vector (free slots included)."""
        return len(self._slots)

    def bit(self, sig: Signature) -> Optional[int]:
        return self._bit.get(sig)

    def at(self, bit: int) -> Signature:
        """The signature of a bit reported ready (which marks it recently used)."""
        sig = self._slots[bit]
        if sig is None:
            raise AssertionError(f"response cache bit {bit} is free but was reported ready; "
                                 "the ranks' caches diverged")
        self._bit.move_to_end(sig)
        return sig

    def by_name(self, name: str) -> Optional[Signature]:
        return self._by_name.get(name)

    def take_changed(self) -> List[int]:
        """The bits freed or given a signature since the last call (bits never move
        otherwise: an entry keeps its bit until it is evicted)."""
        out, self._changed = sorted(self._changed), set()
        return out

    def put(self, sig: Signature) -> None:
        if sig in self._bit:
            return
        self.evict(sig.name)
        if not self._free and len(self._slots) >= self.capacity:
            self.evict(next(iter(self._bit)).name)  # the least recently used
        if self._free:
            bit = heapq.heappop(self._free)
        else:
            bit = len(self._slots)
            self._slots.append(None)
        self._slots[bit] = sig
        self.version += 1
        self._changed.add(bit)
        self._bit[sig] = bit
        self._by_name[sig.name] = sig

    def evict(self, name: str) -> None:
        old = self._by_name.pop(name, None)
        if old is None:
            return
        bit = self._bit.pop(old)
        self.version += 1
        self._changed.add(bit)
        self._slots[bit] = None
        heapq.heappush(self._free, bit)
