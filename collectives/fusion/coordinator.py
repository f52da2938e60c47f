"""One coordination round: which named tensors are ready on every rank.

Every cycle each rank contributes a *coordination vector* of int32 and the
ranks sum it with one small allreduce (the fast path; nothing else is sent
in steady state).  Layout, identical on every rank:

    [0]                 stall: ranks asking for a stall report
    [1 + r]             joined: 1 if rank r has called join()
    [1 + size + r]      shutdown: 1 if rank r is shutting down
    [1 + 2 size + r]    announce: bytes of rank r's new announcements
    [1 + 3 size + b]    bit b of the response cache

A rank sets bit b to DATA (= 1 + 2**16) when it has a request with the
cached signature b pending, and a joined rank sets every other bit to
JOINED (= 1): it will take part with zeros.  After the sum, the low 16 bits
count the ranks that are ready for b and the high bits count those that hold
real data, so b is ready when low == size and high > 0 (not everyone merely
joined).  When any announce slot is non-zero, a *negotiation* follows: one
allgather of every rank's announcements (JSON signatures, see `MessageTable`).
"""
from __future__ import annotations

import json
from typing import List, NamedTuple, Sequence

import numpy as np

from .request import Signature

__all__ = ["DATA", "JOINED", "Layout", "CycleResult", "encode", "gather_announcements", "gather_json"]

DATA = 1 + (1 << 16)
JOINED = 1
_LOW = (1 << 16) - 1
MAX_RANKS = (1 << 15) - 1  # DATA * size must fit in int32


class CycleResult(NamedTuple):
    stall: bool
    joined: tuple          # bool per rank
    shutdown: tuple        # ranks shutting down
    announce: tuple        # bytes of announcements per rank
    ready_bits: list       # cache bits ready on every rank, ascending
    active: bool           # any rank holds data for any cached bit

    @property
    def negotiate(self) -> bool:
        return any(self.announce)


class Layout:
    def __init__(self, size: int) -> None:
        if size > MAX_RANKS:
            raise ValueError(f"the fusion engine supports at most {MAX_RANKS} ranks, got {size}")
        self.size = size
        self.bits = 1 + 3 * size

    def vector(self, rank: int, nbits: int, *, stall: bool, joined: bool, shutdown: bool,
               announce: int) -> np.ndarray:
        vec = np.zeros(self.bits + nbits, np.int32)
        vec[0] = int(stall)
        vec[1 + rank] = int(joined)
        vec[1 + self.size + rank] = int(shutdown)
        vec[1 + 2 * self.size + rank] = announce
        if joined:
            vec[self.bits:] = JOINED
        return vec

    def parse(self, vec: np.ndarray) -> CycleResult:
        n, values = self.size, vec.tolist()  # small: plain Python beats numpy calls
        head, bits = values[:self.bits], values[self.bits:]
        ready = [b for b, v in enumerate(bits) if v & _LOW == n and v > n]
        active = bool(bits) and max(bits) > _LOW
        return CycleResult(
            stall=bool(head[0]),
            joined=tuple(v != 0 for v in head[1:1 + n]),
            shutdown=tuple(r for r, v in enumerate(head[1 + n:1 + 2 * n]) if v),
            announce=tuple(head[1 + 2 * n:1 + 3 * n]),
            ready_bits=ready,
            active=active,
        )


def _split(blob: np.ndarray, lengths: Sequence[int]) -> List[bytes]:
    out, off = [], 0
    for n in lengths:
        out.append(blob[off:off + n].tobytes())
        off += n
    return out


def gather_announcements(comm, payload: bytes, lengths: Sequence[int]) -> List[List[Signature]]:
    """Every rank's announcements, in rank order (lengths came with the vector)."""
    blob = comm.allgather(np.frombuffer(payload, np.uint8) if payload else np.zeros(0, np.uint8),
                          name="fusion.negotiate", control=True)
    return [[Signature.from_json(item) for item in json.loads(part)] if part else []
            for part in _split(np.asarray(blob), lengths)]


def encode(sigs: List[Signature]) -> bytes:
    return json.dumps([list(s) for s in sigs], separators=(",", ":")).encode() if sigs else b""


def gather_json(comm, obj, name: str) -> list:
    """Every rank's JSON-able obj, in rank order (two allgathers: lengths, then bytes)."""
    data = json.dumps(obj, separators=(",", ":")).encode()
    lengths = np.asarray(comm.allgather(np.array([len(data)], np.int64), name=f"{name}.lengths",
                                        control=True))
    blob = comm.allgather(np.frombuffer(data, np.uint8), name=name, control=True)
    return [json.loads(part) for part in _split(np.asarray(blob), [int(v) for v in lengths])]
