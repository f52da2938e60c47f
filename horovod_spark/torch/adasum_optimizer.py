"""DistributedOptimizer(op=hvd.Adasum): the optimizer's *delta* is combined, not the gradient.

As Horovod describes Adasum with an optimizer: each rank applies its own step to
the parameters with its local gradients, the change of every parameter (its
delta: after minus before) is combined over ranks with Adasum, one tensor per
parameter (so each layer has its own dot products), and every rank sets its
parameters to the starting values plus the combined delta.  Parameters and
optimizer state stay identical on every rank as long as they start identical
(broadcast them first, as with any DistributedOptimizer); an optimizer's state
(momentum, Adam's moments) stays each rank's own, as in Horovod.

The combination runs in step(), after the local step: nothing goes on during
backward, so `synchronize()` has nothing to wait for.  With
`backward_passes_per_step` = k the gradients accumulate over k backward passes
before the step, as torch accumulates them.
"""
from __future__ import annotations

import contextlib
import time

import torch

from collectives.adasum import check_world

from .. import progress
from . import _state
from . import adasum as _adasum

__all__ = ["AdasumOptimizer"]


class AdasumOptimizer:
    """Mixed in before the wrapped optimizer's class (see DistributedOptimizer)."""

    def _hvd_adasum_setup(self, names: dict, compression, backward_passes_per_step: int,
                          process_set=None) -> None:
        params = [p for group in self.param_groups for p in group["params"]]
        self._compression = compression
        self._process_set = process_set  # the ranks whose deltas combine (None: every rank)
        self.backward_passes_per_step = int(backward_passes_per_step)
        self._adasum_params = list(dict.fromkeys(p for p in params if p.requires_grad))
        self._adasum_names = [f"DistributedOptimizer.adasum.{names[p]}"
                              for p in self._adasum_params]

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = int(passes)

    def synchronize(self) -> None:
        """Nothing to wait for: the deltas are combined inside step()."""

    @contextlib.contextmanager
    def skip_synchronize(self):
        yield

    def step(self, closure=None):
        ps = _state.view(self._process_set, "DistributedOptimizer(op=Adasum).step")
        if _state.set_size(ps) == 1:  # the tree of one delta is that delta
            _state.record_step(0.0)
            return super().step(closure)
        check_world(_state.set_size(ps), _state.set_rank(ps), "DistributedOptimizer(op=Adasum).step")
        params = self._adasum_params  # (checked before the local step changes them)
        start = [p.detach().clone() for p in params]
        loss = super().step(closure)
        t0 = time.perf_counter()
        with torch.no_grad():
            deltas, ctxs = [], []
            for p, s in zip(params, start):
                d, ctx = self._compression.compress(p.detach() - s)
                deltas.append(d)
                ctxs.append(ctx)
            with _state.waiting_now():  # waited for just below
                handles, finish = _adasum.submit(deltas, self._adasum_names, inplace=True, ps=ps)
            combined = finish([h.wait() for h in handles])
            for p, s, d, ctx in zip(params, start, combined, ctxs):
                p.copy_(s + self._compression.decompress(d, ctx))
        _state.record_step(time.perf_counter() - t0)
        return loss

    step.hooked = True  # torch's step profiling wrapper already wraps the base class's step


progress.count_steps_of(AdasumOptimizer)  # its steps are the training steps


def wrap(optimizer, names: dict, compression, backward_passes_per_step: int, process_set=None):
    """`optimizer` as an instance of a subclass of its class, sharing its state."""
    cls = type(optimizer.__class__.__name__, (AdasumOptimizer, optimizer.__class__), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped._hvd_adasum_setup(names, compression, backward_passes_per_step, process_set)
    return wrapped
