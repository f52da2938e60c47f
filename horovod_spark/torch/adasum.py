"""Adasum for torch tensors: `op=hvd.Adasum` on allreduce and grouped allreduce.

Each tensor travels as its own named allgather (flattened, on the CPU) and every
rank combines the gathered rows with `collectives.adasum.tree`, so a group's
tensors combine separately, each with its own dot products.  bfloat16, which
numpy lacks, travels and combines as float32 and is rounded once at the end;
CUDA tensors go through host memory.
"""
from __future__ import annotations

from typing import Callable, List, Sequence, Tuple

import torch

from collectives.adasum import check_world, tree

from . import _state
from ._errors import InvalidArgument

__all__ = ["submit"]

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _wire(t: torch.Tensor, prescale: float) -> torch.Tensor:
    w = t.detach().to("cpu", torch.float32 if t.dtype == torch.bfloat16 else t.dtype)
    w = w.reshape(-1).contiguous()
    return w * prescale if prescale != 1.0 else w


def submit(tensors: Sequence[torch.Tensor], names: Sequence[str], inplace: bool,
           prescale: float = 1.0, postscale: float = 1.0, ps=None) -> Tuple[list, Callable]:
    """Submit the tensors' allgathers (among the process set `ps`, a view; None: every
    rank); returns (engine handles, finish(results))."""
    size = _state.set_size(ps)
    check_world(size, _state.set_rank(ps), f"allreduce '{names[0]}'" if names else "allreduce")
    for t, name in zip(tensors, names):
        if t.dtype not in _FLOATING:
            raise InvalidArgument(f"allreduce '{name}': Adasum combines floating tensors "
                                  f"(float16, bfloat16, float32, float64), got {t.dtype}")
    handles = [_state.submit(name, "allgather", _wire(t, prescale), strict_join=True, view=ps)
               for t, name in zip(tensors, names)]

    def finish(results: List[torch.Tensor]) -> list:
        outs = []
        for t, gathered in zip(tensors, results):
            rows = gathered.numpy().reshape(size, t.numel())
            r = torch.from_numpy(tree(rows)).reshape(t.shape).to(t.device, t.dtype)
            if postscale != 1.0:
                r = r * postscale
            if inplace:
                with torch.no_grad():  # as the engine writes an in-place result
                    t.copy_(r)
            outs.append(t if inplace else r)
        return outs
    return handles, finish
