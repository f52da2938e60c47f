"""DistributedOptimizer: allreduce gradients while backward is still running.

The gradients live in *buckets* (see buckets): every gradient is a view of a
flat buffer per run of parameters, dtype and device, so one in-place
allreduce per bucket averages them, with nothing packed or unpacked.  A hook
on every parameter (`register_post_accumulate_grad_hook`) fires as soon as
autograd has accumulated that parameter's gradient; once every member of a
bucket has fired, the bucket's allreduce goes to the fusion engine, so the
communication of the last layers overlaps the backward pass of the first.
With `backward_passes_per_step` = k, a parameter's gradient accumulates
locally for k backward passes (its *delay* counts down) and counts as ready on
the k-th.  A parameter that can't be a view (not contiguous) goes alone, as
soon as it is ready.

The runs: `num_groups=k` cuts the parameters into k runs in order, `groups`
names them; `num_groups=0` asks for overlap: runs in reverse order (autograd
finishes the last layers first), the first about 1 MiB so that the first
allreduce starts early, the others about 25 MiB (DDP's sizes).  By default
(`num_groups=None`) the optimizer decides, once for the world: where any rank is
a CPU rank with no spare core (local ranks x torch threads >= the cores this
process may use), gradients go as one run at the end of backward, because
there the engine's thread can only run on a core that backward needs, and
overlap costs more than it hides (the torch training benchmark); anywhere
else, overlap.  `step()` first calls
`synchronize()`: it submits what no hook did (a parameter unused this step is
reduced as zeros, so every rank submits the same names) and waits for every
handle.  `zero_grad()` zeroes each bucket in one kernel and leaves the
gradients as views (zeros, not None), so the next backward accumulates into
the buckets without a copy.

The returned object is an instance of a subclass of the wrapped optimizer's
class that shares its state, so `isinstance(opt, torch.optim.SGD)` holds and
checkpoints load as before.
"""
from __future__ import annotations

import contextlib
import time
import warnings
import weakref

import torch

from collectives.backends.native import usable_cores

from .. import progress
from . import _state, adasum_optimizer
from . import mpi_ops as M
from .buckets import Bucket, make_buckets, overlap_runs
from .compression import Compression

__all__ = ["DistributedOptimizer"]


class _DistributedOptimizer:
    def _hvd_setup(self, named_parameters, compression, backward_passes_per_step, op,
                   gradient_predivide_factor, groups, sparse_as_dense: bool = False,
                   process_set=M.global_process_set) -> None:
        self._compression = compression
        self._process_set = process_set
        self._sparse_as_dense = bool(sparse_as_dense)
        self._densified: set = set()  # sparse gradients reduced dense, sparse again after
        self._sparse_keys: set = set()  # parameters whose gradient goes sparse this step
        self._op = op
        self._predivide = float(gradient_predivide_factor)
        self.backward_passes_per_step = int(backward_passes_per_step)
        params = [p for group in self.param_groups for p in group["params"]]
        self._parameter_names = _parameter_names(named_parameters, params)
        self._requires_update = list(dict.fromkeys(p for p in params if p.requires_grad))
        self._delay = {p: self.backward_passes_per_step for p in params}
        runs = _runs(groups, self._requires_update)
        self._overlap = not groups  # runs cut by size, submitted as they fill during backward
        self._buckets, self._bucket_of, self._loose = make_buckets(runs, self._parameter_names)
        # one run: it is submitted at the end of backward and waited for in step(), with
        # nothing to overlap in between, so it goes lazily (the wait runs its cycle)
        self._one_group = len(runs) == 1
        self._handles: dict = {}  # bucket or loose parameter -> (handle, ctx); None: not yet
        self._synchronized = False
        self._should_synchronize = True
        self._last_wait = 0.0
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(p))
                       for p in self._requires_update]

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = int(passes)
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step

    def _make_hook(self, p):
        ref = weakref.ref(self)  # a dropped optimizer must not keep reducing its gradients

        def hook(_param):
            self = ref()
            if self is None:
                return
            bucket = self._bucket_of.get(p)
            if self._delay[p] <= 0:
                raise AssertionError(
                    "Gradients were computed more than backward_passes_per_step times before "
                    "call to step(). Increase backward_passes_per_step to accumulate gradients "
                    "locally.")
            if self._sparse_as_dense and p.grad is not None and p.grad.is_sparse:
                p.grad = p.grad.to_dense()
                self._densified.add(p)
            if bucket is not None:
                bucket.attach(p)  # later passes then accumulate into the view
            self._delay[p] -= 1
            key = p if bucket is None else bucket
            self._handles.setdefault(key, None)
            if self._delay[p] == 0:
                if bucket is None:
                    self._submit_loose(p)
                else:
                    bucket.ready += 1
                    if bucket.ready == len(bucket.members):
                        self._submit_bucket(bucket)
        return hook

    def _submit_bucket(self, bucket) -> None:
        with _state.waiting_now() if self._one_group else contextlib.nullcontext():
            self._handles[bucket] = self._allreduce_async(bucket.flat, bucket.name)
            for p in bucket.sparse:
                self._submit_sparse(p)

    def _submit_loose(self, p) -> None:
        if p.grad.is_sparse:
            return self._submit_sparse(p)
        grad = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
        self._handles[p] = self._allreduce_async(grad, self._parameter_names[p])

    def _submit_sparse(self, p) -> None:
        """A sparse gradient (nn.Embedding(sparse=True)): allgathered, kept sparse."""
        op = self._op if self._op in (M.Average, M.Sum) else None
        if op is None:
            raise ValueError(f"sparse gradient of '{self._parameter_names[p]}': sparse "
                             "gradients reduce with Average or Sum; pass sparse_as_dense=True")
        self._sparse_keys.add(p)
        self._handles[p] = (M.sparse_allreduce_async(p.grad, self._parameter_names[p], op,
                                                     process_set=self._process_set), None)

    def _allreduce_async(self, tensor, name: str):
        compressed, ctx = self._compression.compress(tensor)
        pre, post = 1.0, 1.0
        if self._op == M.Average and self._predivide != 1.0:
            pre, post = 1.0 / self._predivide, self._predivide
        handle = M.allreduce_async_(compressed, name=name, op=self._op,
                                    prescale_factor=pre, postscale_factor=post,
                                    process_set=self._process_set)
        return handle, ctx

    def _submit_the_rest(self) -> None:
        """What no hook submitted: a parameter unused this step on this rank (another rank
        may have used it) is reduced as zeros, so every rank submits the same names."""
        for bucket in self._buckets:
            if self._handles.get(bucket) is None:
                for p in bucket.members:
                    bucket.attach(p)
                self._submit_bucket(bucket)
        for p in self._loose:
            if self._handles.get(p) is None:
                if p.grad is None:  # unused this step on this rank
                    p.grad = torch.zeros_like(p)
                self._submit_loose(p)

    def synchronize(self) -> None:
        """Wait for every gradient's allreduce; the averaged gradients are in .grad."""
        t0 = time.perf_counter()
        with _state.waiting_now():  # waited for just below
            self._submit_the_rest()
        for key, (handle, ctx) in self._handles.items():
            out = self._compression.decompress(M.synchronize(handle), ctx)
            if key in self._sparse_keys:
                key.grad = out
                continue
            target = key.flat if isinstance(key, Bucket) else key.grad
            if out.data_ptr() != target.data_ptr():
                target.copy_(out)
        for p in self._densified:  # as Horovod: the optimizer gets the sparse form back
            p.grad = p.grad.to_sparse()
        self._densified.clear()
        for p in self._requires_update:
            self._delay[p] = self.backward_passes_per_step
        for bucket in self._buckets:
            bucket.ready = 0
        self._handles.clear()
        self._sparse_keys.clear()
        self._synchronized = True
        self._last_wait = time.perf_counter() - t0

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Use after an explicit synchronize() (e.g. to clip gradients) so step() skips it."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self.synchronize()
        self._synchronized = False
        _state.record_step(self._last_wait)
        self._last_wait = 0.0
        return super().step(closure)

    step.hooked = True  # torch's step profiling wrapper already wraps the base class's step

    def zero_grad(self, set_to_none: bool = True):
        """Clear the gradients.  A bucketed gradient is zeroed in place, with its bucket
        in one kernel, and stays a view of it (not None), so the next backward
        accumulates into the bucket without a copy; other gradients follow set_to_none."""
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize(). This is "
                                 "prohibited as it can cause a race condition.")
        if self._loose or not set_to_none:
            super().zero_grad(set_to_none)  # (a bucket's gradients are its views again below)
        for bucket in self._buckets:
            bucket.zero()


progress.count_steps_of(_DistributedOptimizer)  # its steps are the training steps


def _crowded(params) -> bool:
    """This rank's own verdict: CPU gradients and no spare core on its host."""
    if not params or any(p.device.type != "cpu" for p in params):
        return False
    return _state.local_size() * torch.get_num_threads() >= usable_cores()


def auto_groups(params, process_set=M.global_process_set) -> int:
    """num_groups=None: 1 (no overlap) when any rank is a CPU rank without a spare core,
    else 0 (overlap).  Cores, threads and local sizes differ between hosts, and ranks
    with different layouts submit bucket names that never match, so the verdict is
    agreed by the ranks that reduce together (a MAX allreduce) before any bucket exists."""
    verdict = torch.tensor([1 if _crowded(params) else 0], dtype=torch.int32)
    if _state.set_size(_state.view(process_set, "DistributedOptimizer")) > 1:
        with _state.waiting_now():
            handle = M.allreduce_async(verdict, op=M.Max, name="DistributedOptimizer.layout",
                                       process_set=process_set)
        verdict = M.synchronize(handle)
    return int(verdict.item())


def _runs(groups, params) -> list:
    """The runs of parameters that travel together (see buckets): an int splits `params`
    into that many runs in order; explicit groups are runs (parameters in none of them
    travel as with overlap); 0 or None: overlap runs."""
    if not groups:
        return overlap_runs(params)
    if isinstance(groups, int):
        n = max(1, min(groups, len(params)))
        size, extra = divmod(len(params), n)
        runs, start = [], 0
        for i in range(n):
            end = start + size + (1 if i < extra else 0)
            runs.append(params[start:end])
            start = end
        return runs
    wanted = set(params)
    runs = [[p for p in dict.fromkeys(g) if p in wanted] for g in groups]
    runs = [run for run in runs if run]
    grouped = {p for run in runs for p in run}
    return runs + overlap_runs([p for p in params if p not in grouped])


def _parameter_names(named_parameters, params) -> dict:
    if named_parameters is None:
        return {p: f"noname.{i}" for i, p in enumerate(params)}
    named = list(named_parameters)
    if named and not all(isinstance(item, tuple) and len(item) == 2 for item in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: "
                         f"{', '.join(dups)}")
    by_param = {p: n for n, p in named}
    unnamed = [i for i, p in enumerate(params) if p not in by_param]
    if unnamed:
        raise ValueError(f"named_parameters was specified, but one or more model parameters were "
                         f"not named (optimizer parameters at positions {unnamed})")
    return by_param


class _LocalOptimizer:
    """DistributedOptimizer on a rank outside its process set: the wrapped optimizer's
    own step on this rank's gradients, with the distributed optimizer's methods."""

    def synchronize(self) -> None:
        """Nothing to wait for: this rank reduces with no one."""

    @contextlib.contextmanager
    def skip_synchronize(self):
        yield

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = int(passes)


def _local(optimizer, backward_passes_per_step: int):
    cls = type(optimizer.__class__.__name__, (_LocalOptimizer, optimizer.__class__), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped.backward_passes_per_step = int(backward_passes_per_step)
    return wrapped


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step: int = 1, op=M.Average,
                         gradient_predivide_factor: float = 1.0, num_groups=None,
                         groups=None, sparse_as_dense: bool = False,
                         process_set=M.global_process_set):
    """Wrap a torch optimizer so that step() applies gradients averaged over every rank.

    Args:
        named_parameters: model.named_parameters(), to name each gradient's allreduce.
        compression: Compression.none or Compression.fp16 for the allreduce.
        backward_passes_per_step: backward passes that accumulate locally before reducing.
        op: Average (default), Sum, Min, Max, Product, or Adasum: each rank steps
            with its own gradients and the parameters' deltas are combined with
            Adasum (see adasum_optimizer).
        gradient_predivide_factor: with Average, divide by this before the sum and by
            size/factor after it.
        num_groups / groups: the runs of gradients that travel together (num_groups runs
            of the parameters in order, or explicit lists of parameters): each run's
            gradients are views of one flat buffer per dtype and device (a bucket),
            reduced in place once all its members are ready.  num_groups=0: overlap
            with backward, in buckets of about 1 MiB first, then 25 MiB.  None
            (default): 1 on CPU ranks without a spare core, else 0.
        process_set: the ranks whose gradients are averaged (every rank by default); on a
            rank outside it the optimizer steps on its own gradients, as Horovod's does.
    """
    if process_set is not None and process_set.included() is False:
        return _local(optimizer, backward_passes_per_step)
    _state.view(process_set, "DistributedOptimizer")
    op = M.handle_average_backwards_compatibility(op, None)
    if gradient_predivide_factor != 1.0 and op != M.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    if groups is not None and num_groups:
        raise ValueError("pass either num_groups or groups, not both")
    _state.engine()  # fail early, with the init() hint, when not initialized
    if op is M.Adasum:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        return adasum_optimizer.wrap(optimizer, _parameter_names(named_parameters, params),
                                     compression, backward_passes_per_step, process_set)
    cls = type(optimizer.__class__.__name__, (_DistributedOptimizer, optimizer.__class__), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    if groups is None and num_groups is None:
        num_groups = auto_groups([p for g in optimizer.param_groups for p in g["params"]
                                  if p.requires_grad], process_set)
    wrapped._hvd_setup(named_parameters, compression, backward_passes_per_step, op,
                       gradient_predivide_factor, groups if groups is not None else num_groups,
                       sparse_as_dense, process_set)
    return wrapped
