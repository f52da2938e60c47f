"""The NCCL calls one rank makes for a collective, as data, so they are tested without a GPU.

Terms: a *plan* is the list of `Call`s one rank issues for one collective,
in order; calls of one plan run inside one NCCL group (ncclGroupStart/End)
when there is more than one.  Offsets and counts are in elements.  `src` and
`dst` name the op's input and output buffers; a broadcast call whose source
is `dst` is in place (a non-root rank receiving into its slot).  Every rank
derives its plan from the same counts, so the ranks' plans pair up call by
call: the k-th broadcast of every rank has the same root and count.

* allgather, equal counts: one ncclAllGather; per-rank counts: one
  ncclBroadcast per rank with a non-empty block, rooted at that rank, each
  rank receiving into the block's offset (the NCCL user guide's allgatherv).
* reducescatter, equal counts: one ncclReduceScatter; per-rank counts: one
  ncclReduce per non-empty block, rooted at the rank that keeps it.
* alltoall: a local copy of this rank's own block, then one ncclSend and one
  ncclRecv per peer with a non-empty block, grouped.
Empty blocks issue no call (every rank skips the same ones).
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

__all__ = ["Call", "plan_allgather", "plan_reducescatter", "plan_alltoall", "offsets", "check_counts"]


@dataclasses.dataclass(frozen=True)
class Call:
    kind: str            # allgather, broadcast, reducescatter, reduce, send, recv, copy
    count: int
    src_off: int = 0
    dst_off: int = 0
    peer: Optional[int] = None   # root of broadcast / reduce, peer of send / recv
    src_buf: str = "src"         # "dst": the call reads the output buffer (in place)


def offsets(counts: Sequence[int]) -> List[int]:
    out, at = [], 0
    for c in counts:
        out.append(at)
        at += int(c)
    return out


def plan_allgather(counts: Sequence[int], me: int) -> List[Call]:
    counts = [int(c) for c in counts]
    if len(set(counts)) == 1:
        return [Call("allgather", counts[0])] if counts[0] else []
    calls = []
    for root, (off, c) in enumerate(zip(offsets(counts), counts)):
        if c == 0:
            continue
        if root == me:
            calls.append(Call("broadcast", c, src_off=0, dst_off=off, peer=root))
        else:
            calls.append(Call("broadcast", c, src_off=off, dst_off=off, peer=root, src_buf="dst"))
    return calls


def plan_reducescatter(counts: Sequence[int], me: int) -> List[Call]:
    counts = [int(c) for c in counts]
    if len(set(counts)) == 1:
        return [Call("reducescatter", counts[0])] if counts[0] else []
    # dst_off is this rank's output offset, used only where it is the root;
    # elsewhere NCCL ignores the output pointer (the executor passes the input's).
    return [Call("reduce", c, src_off=off, dst_off=0, peer=root)
            for root, (off, c) in enumerate(zip(offsets(counts), counts)) if c]


def plan_alltoall(send_counts: Sequence[int], recv_counts: Sequence[int], me: int) -> List[Call]:
    send_counts = [int(c) for c in send_counts]
    recv_counts = [int(c) for c in recv_counts]
    if send_counts[me] != recv_counts[me]:
        raise ValueError(f"alltoall: rank {me} sends {send_counts[me]} elements to itself but "
                         f"expects {recv_counts[me]}")
    soff, roff = offsets(send_counts), offsets(recv_counts)
    calls = []
    if send_counts[me]:
        calls.append(Call("copy", send_counts[me], src_off=soff[me], dst_off=roff[me]))
    for peer in range(len(send_counts)):
        if peer == me:
            continue
        if send_counts[peer]:
            calls.append(Call("send", send_counts[peer], src_off=soff[peer], peer=peer))
        if recv_counts[peer]:
            calls.append(Call("recv", recv_counts[peer], dst_off=roff[peer], peer=peer))
    return calls

def check_counts(op: str, mine: int, total: int, counts: Sequence[int], rank: int, mine_is: str) -> None:
    if len(counts) == 0 or min(counts) < 0:
        raise ValueError(f"{op}: counts {list(counts)} must be one non-negative number per rank")
    if mine != counts[rank] or total != sum(counts):
        other = "output" if mine_is == "input" else "input"
        raise ValueError(f"{op}: {mine_is} of {mine} and {other} of {total} elements do not match "
                         f"counts {list(counts)} on rank {rank}")
