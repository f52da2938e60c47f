"""The Spark Store: rank publications relayed through BarrierTaskContext.allGather.

Terms.  A *publication* is the one key a rank sets per communicator
generation to announce itself: `{job}/.../rank/{rank}` (the mesh publishes
`{job}/comm{gen}/mesh/rank/{rank}`, its host:port, host identity and pid; the
NCCL unique id of rank 0 rides in the same blob).  A *round* is one
`allGather` call made by every task of the barrier stage: each task sends its
rank's publication and receives every rank's, in rank order.  The *local*
store is the task's own TCP store server, which its rank process talks to.

Every task runs the same rounds in the same order because every rank sets
exactly one publication per generation; that is the bootstrap contract of
docs/architecture.md.  Any other key stays in the local store.  Keys are
prefixed by the job and its attempt (`job`), and a message whose key lies
outside that prefix, or claims another rank's publication as its own, is
refused, so a stale round of an earlier attempt can never be mixed in.
"""
from __future__ import annotations

import base64
import json
import re
from typing import Callable, List, Optional

from collectives.store import InMemoryStore, Store

__all__ = ["SparkStore"]


class SparkStore(Store):
    """A Store for one barrier task whose publications travel through allGather.

    Args:
        all_gather: `BarrierTaskContext.allGather` (str -> list of str, rank order).
        rank: this task's rank (its partition id).
        job: the key prefix of this job and attempt.
        local: where keys live in this task (default: a new in-memory store).
    """

    def __init__(self, all_gather: Callable[[str], List[str]], rank: int, job: str,
                 local: Optional[Store] = None) -> None:
        self._all_gather, self.rank, self.job = all_gather, rank, job.rstrip("/")
        self.local = local if local is not None else InMemoryStore()
        self._pattern = re.compile(re.escape(self.job) + r"/(?:.+/)?rank/(\d+)")
        self.rounds = 0

    def publication_rank(self, key: str) -> Optional[int]:
        """The rank a publication key belongs to, or None if `key` is not one."""
        m = self._pattern.fullmatch(key)
        return int(m.group(1)) if m else None

    def is_own_publication(self, key: str) -> bool:
        return self.publication_rank(key) == self.rank

    def publish(self, key: str, value: bytes) -> None:
        """One round: send this rank's publication, store every rank's."""
        if not self.is_own_publication(key):
            raise ValueError(f"{key!r} is not a publication of rank {self.rank} in job {self.job!r}")
        msg = json.dumps({"k": key, "v": base64.b64encode(bytes(value)).decode()})
        replies = self._all_gather(msg)
        self.rounds += 1
        for sender, reply in enumerate(replies):
            k, v = self._decode(sender, reply)
            if sender != self.rank:
                self.local.set(k, v)

    def _decode(self, sender: int, reply: str):
        try:
            obj = json.loads(reply)
            key, value = obj["k"], base64.b64decode(obj["v"])
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"allGather round {self.rounds}: task {sender} sent a malformed "
                             f"publication") from None
        if self.publication_rank(key) != sender:
            raise ValueError(f"allGather round {self.rounds}: task {sender} sent {key!r}, which is "
                             f"not its publication in job {self.job!r}; are two jobs or attempts "
                             f"mixed in one barrier stage?")
        return key, value

    def set(self, key, value):
        if self.is_own_publication(key):
            self.local.set(key, value)
            self.publish(key, value)
        else:
            self.local.set(key, value)

    def get(self, key, timeout=None):
        return self.local.get(key, timeout)

    def add(self, key, amount):
        return self.local.add(key, amount)

    def delete(self, key):
        self.local.delete(key)

    def check(self, key):
        return self.local.check(key)
