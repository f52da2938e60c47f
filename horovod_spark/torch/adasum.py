"""Adasum for torch tensors: `op=hvd.Adasum` on allreduce and grouped allreduce.

Each tensor is an allreduce of the fusion engine with op ADASUM (flattened, on the
CPU): the engine negotiates and fuses them like sums, and the backend combines
each tensor of a fused buffer on its own, with its own dot products (on the native
backend by vector halving, distance doubling: native/src/adasum.cc).  bfloat16
combines widened to float32 and is rounded once at the end; CUDA tensors go through
host memory.
"""
from __future__ import annotations

from typing import Callable, List, Sequence, Tuple

import torch

from collectives import ReduceOp
from collectives.adasum import check_world

from . import _state
from ._errors import InvalidArgument

__all__ = ["submit"]

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _wire(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").reshape(-1).contiguous()


def submit(tensors: Sequence[torch.Tensor], names: Sequence[str], inplace: bool,
           prescale: float = 1.0, postscale: float = 1.0, ps=None) -> Tuple[list, Callable]:
    """Submit the tensors' Adasum allreduces (among the process set `ps`, a view; None:
    every rank); returns (engine handles, finish(results))."""
    check_world(_state.set_size(ps), _state.set_rank(ps),
                f"allreduce '{names[0]}'" if names else "allreduce")
    for t, name in zip(tensors, names):
        if t.dtype not in _FLOATING:
            raise InvalidArgument(f"allreduce '{name}': Adasum combines floating tensors "
                                  f"(float16, bfloat16, float32, float64), got {t.dtype}")
    handles = [_state.submit(name, "allreduce", _wire(t), op=ReduceOp.ADASUM, prescale=prescale,
                             postscale=postscale, view=ps)
               for t, name in zip(tensors, names)]

    def finish(results: List[torch.Tensor]) -> list:
        outs = []
        for t, r in zip(tensors, results):
            r = r.reshape(t.shape).to(t.device, t.dtype)
            if inplace:
                with torch.no_grad():  # as the engine writes an in-place result
                    t.copy_(r)
            outs.append(t if inplace else r)
        return outs
    return handles, finish
