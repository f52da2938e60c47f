"""The mesh's plan: which ranks share memory, which pairs hold a TCP link, decided once.

Terms (mesh.py uses the same words).
  entry    what a rank publishes about itself: where it listens, its host, pid, the
           /dev/shm it sees, its integrity mode, whether it runs every rank as a host
  group    the ranks of one host that see one /dev/shm (shared memory joins them); with
           force_tcp every rank is a group of its own
  leader   the lowest rank of a group; the leaders, in rank order, are the *TCP group*
           (a world of one group has none)
  links    the pairs of leaders the TCP algorithms talk over.  For leader index i of n:
           i +- 2^k for every 2^k < n (the ring's neighbours at k = 0, the dissemination
           barrier's rounds), and recursive doubling's partners: with p the largest
           power of two <= n, i ^ 2^k for i < p, and i + p <-> i for i + p < n (the
           ranks above p fold into those below).  So a leader holds O(log n) links, and
           a rank that leads no group holds none
  plan     what rank 0 decides from every entry and publishes once: the groups (where
           a host is split, or the launcher gave no placement, its hosts too), the
           integrity mode, or the error every rank raises

Alltoall (and Adasum's exchanges) talk to every pair: their first op connects the pairs
not linked here (`mesh.Mesh.connect_all`), so a job that never calls them never has them.
"""
from __future__ import annotations

import hashlib
import json
from typing import Dict, List, Optional, Sequence

from ..launch.rankenv import decode_hosts, encode_hosts

__all__ = ["link_peers", "leaders_of", "make_plan", "groups_of", "map_digest", "PlanError"]


class PlanError(Exception):
    """What rank 0 found: every rank raises it (kind: "timeout", "lost" or "value")."""

    def __init__(self, kind: str, what: str, peer: Optional[int] = None,
                 hint: Optional[str] = None) -> None:
        super().__init__(what)
        self.kind, self.what, self.peer, self.hint = kind, what, peer, hint


def map_digest(hosts: Sequence[str]) -> str:
    """A short name of a placement (every rank's host), for ranks to see they share one."""
    return hashlib.sha256(encode_hosts(hosts).encode()).hexdigest()[:16] if hosts else ""


def leaders_of(groups: Sequence) -> List[int]:
    """The lowest rank of each group, in rank order."""
    seen: Dict = {}
    for r, g in enumerate(groups):
        seen.setdefault(g, r)
    return sorted(seen.values())


def link_peers(rank: int, groups: Sequence, leaders: Optional[List[int]] = None) -> List[int]:
    """The world ranks `rank` holds a TCP link to (see the module docstring)."""
    leaders = leaders_of(groups) if leaders is None else leaders
    n = len(leaders)
    if n < 2:
        return []
    try:
        i = leaders.index(rank)
    except ValueError:
        return []
    peers = set()
    k = 1
    while k < n:
        peers.add(leaders[(i + k) % n])
        peers.add(leaders[(i - k) % n])
        k *= 2
    p = 1 << (n.bit_length() - 1)
    if i < p:
        k = 1
        while k < p:
            peers.add(leaders[i ^ k])
            k *= 2
        if i + p < n:
            peers.add(leaders[i + p])
    else:
        peers.add(leaders[i - p])
    peers.discard(rank)
    return sorted(peers)


def _labels(entries: Sequence[dict], force_tcp: bool) -> list:
    if force_tcp:
        return [f"{e['host']}#{r}" for r, e in enumerate(entries)]
    return [f"{e['host']}|{e.get('shm', '')}" for e in entries]


def make_plan(entries: Sequence[dict]) -> dict:
    """Rank 0's plan from every rank's entry (rank order); PlanError where they disagree."""
    modes = {e.get("integrity") for e in entries}
    if len(modes) > 1:
        raise PlanError("value", "ranks disagree on HOROVOD_SPARK_MESH_INTEGRITY: " + ", ".join(
            f"rank {r}: {e.get('integrity')}" for r, e in enumerate(entries)),
            hint="give every rank the same value (the job's environment)")
    tcps = {bool(e.get("tcp")) for e in entries}
    if len(tcps) > 1:
        raise PlanError("value", "ranks disagree on HOROVOD_SPARK_FORCE_TCP: " + ", ".join(
            f"rank {r}: {int(bool(e.get('tcp')))}" for r, e in enumerate(entries)),
            hint="give every rank the same value (the job's environment)")
    force_tcp = tcps.pop()
    hosts = [e["host"] for e in entries]
    plan: dict = {"integrity": modes.pop(), "tcp": force_tcp}
    digests = {e.get("map", "") for e in entries}
    if digests != {map_digest(hosts)}:  # not every rank was given this placement
        plan["hosts"] = encode_hosts(hosts)
    labels = _labels(entries, force_tcp)
    if not force_tcp and _partition(labels) != _partition(hosts):  # a host split by /dev/shm
        plan["groups"] = encode_hosts(labels)
    return plan


def _partition(labels: Sequence) -> list:
    first: Dict = {}
    return [first.setdefault(x, r) for r, x in enumerate(labels)]


def groups_of(plan: dict, hosts: Sequence[str]) -> tuple:
    """Every rank's group (as mesh.Topology's shm_groups), from the plan and the hosts."""
    if plan.get("tcp"):
        return tuple(f"{h}#{r}" for r, h in enumerate(hosts))
    if "groups" in plan:
        return decode_hosts(plan["groups"])
    return tuple(hosts)


def encode(plan: dict) -> bytes:
    return json.dumps(plan, separators=(",", ":")).encode()


def decode(blob: bytes) -> dict:
    return json.loads(blob)
