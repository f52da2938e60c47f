"""Gradient buckets: the optimizer's gradients as views of flat buffers.

Terms.  A *run* is a list of parameters that travel together (all of them, a
`num_groups` run, an explicit group, or, for overlap, a stretch of about
`BUCKET_BYTES` in reverse order, since autograd finishes the last layers
first).  A *bucket* is the part of a run of one dtype and device: one flat
buffer, and each member's *view* of it, in run order.  Every member's
`.grad` is its view, so autograd accumulates into the buffer in place, one
in-place allreduce of the buffer averages every member at once, and nothing
is copied in or out (DDP's `gradient_as_bucket_view`).  A gradient autograd
made anew (after `model.zero_grad()` set it to None, say) is copied into its
view once and replaced by it (`attach`).

Overlap wants the first bucket small (DDP's 1 MiB), so that the first
allreduce starts early in backward, and the others larger, so that few
submissions carry the model.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

__all__ = ["Bucket", "make_buckets", "overlap_runs", "FIRST_BUCKET_BYTES", "BUCKET_BYTES"]

FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20


class Bucket:
    """One flat buffer whose views are its members' gradients."""

    __slots__ = ("name", "members", "flat", "views", "ready", "sparse")

    def __init__(self, name: str, members: Sequence[torch.Tensor]) -> None:
        first = members[0]
        self.name, self.members = name, tuple(members)
        self.flat = torch.zeros(sum(p.numel() for p in members), dtype=first.dtype,
                                device=first.device)
        self.views: Dict[torch.Tensor, torch.Tensor] = {}
        offset = 0
        for p in members:
            self.views[p] = self.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.ready = 0  # members whose gradient is final this step
        self.sparse: set = set()  # members whose gradients came sparse: they stay sparse

    def attach(self, p: torch.Tensor) -> None:
        """Make p.grad its view: a new gradient is copied in, a missing one is zeros."""
        view, grad = self.views[p], p.grad
        if grad is view:
            return
        if grad is None:
            view.zero_()
        elif grad.is_sparse:  # reduced apart (sparse optimizers need it sparse); view unused
            self.sparse.add(p)
            view.zero_()
            return
        elif grad.layout != torch.strided:
            raise TypeError(f"the gradient of a parameter of shape {tuple(p.shape)} is "
                            f"{grad.layout}, which cannot be reduced")
        else:
            view.copy_(grad)
        p.grad = view

    def zero(self) -> None:
        """Zero every member's gradient in one kernel, keeping the views."""
        self.flat.zero_()
        for p, view in self.views.items():
            if p in self.sparse or p.grad is None or p.grad.is_sparse:
                p.grad = None  # None: its kind unseen; sparse (given back sparse after a
                #                dense reduction): the next backward makes it sparse again
            elif p.grad is not view:
                p.grad = view


def _bucketable(p: torch.Tensor) -> bool:
    return p.layout == torch.strided and p.is_contiguous()


def overlap_runs(params: Sequence[torch.Tensor]) -> List[List[torch.Tensor]]:
    """Runs in reverse order: the first up to FIRST_BUCKET_BYTES, then BUCKET_BYTES each."""
    runs: List[List[torch.Tensor]] = []
    current: List[torch.Tensor] = []
    size, cap = 0, FIRST_BUCKET_BYTES
    for p in reversed(list(params)):
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= cap:
            runs.append(current)
            current, size, cap = [], 0, BUCKET_BYTES
    return runs + ([current] if current else [])


def make_buckets(runs: Sequence[Sequence[torch.Tensor]], names: Dict[torch.Tensor, str]
                 ) -> Tuple[List[Bucket], Dict[torch.Tensor, Bucket], List[torch.Tensor]]:
    """(buckets, {parameter: its bucket}, parameters that can't be views: each goes alone).

    A bucket is named after its first and last members, the same on every rank that
    built the same model."""
    buckets: List[Bucket] = []
    loose: List[torch.Tensor] = []
    for run in runs:
        kinds: Dict[tuple, List[torch.Tensor]] = {}
        for p in run:
            if _bucketable(p):
                kinds.setdefault((p.dtype, p.device), []).append(p)
            else:
                loose.append(p)
        for members in kinds.values():
            first, last = names[members[0]], names[members[-1]]
            buckets.append(Bucket(first if len(members) == 1 else f"{first}..{last}", members))
    bucket_of = {p: b for b in buckets for p in b.members}
    return buckets, bucket_of, loose
