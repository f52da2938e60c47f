"""Work that runs inside rank processes: the soak, a checkpointing trainer, bad input.

Pickled by value like `_fault_ranks` (Spark's executors cannot import either).
"""
from __future__ import annotations

import os

import cloudpickle
import numpy as np

from _fault_ranks import die_now

SOAK_DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64")


# --------------------------------------------------------------------------- soak

def soak_shapes(seed, batch, max_elems):
    """(count, dtype) per tensor name: the first half of the names keep theirs for the
    whole soak (the engine's response cache serves them), the rest draw new ones."""
    rng = np.random.default_rng(seed)
    return [(int(rng.integers(0, max_elems + 1)), SOAK_DTYPES[int(rng.integers(len(SOAK_DTYPES)))])
            for _ in range(batch // 2)]


def soak_batch(rng, size, batch, max_elems, fixed):
    """One batch: (name, dtype name, every rank's values as float64) per tensor."""
    out = []
    for i in range(batch):
        if i < len(fixed):
            n, dt = fixed[i]
        else:
            tiny = rng.random() >= 0.9
            n = int(rng.integers(0, 8)) if tiny else int(rng.integers(0, max_elems + 1))
            dt = SOAK_DTYPES[int(rng.integers(len(SOAK_DTYPES)))]
        low = 0 if dt == "uint8" else -4
        vals = rng.integers(low, 5, size=(size, n)).astype(np.float64)  # sums stay exact
        out.append((f"t{i}", dt, vals))
    return out


def _exact_batch(hvd, torch, rank, items, digest) -> int:
    """Allreduce one batch asynchronously; returns how many results differ from numpy."""
    tensors = [torch.from_numpy(v[rank]).to(getattr(torch, dt)) for _, dt, v in items]
    handles = [hvd.allreduce_async(t, name=name, op=hvd.Sum)
               for (name, _, _), t in zip(items, tensors)]
    wrong = 0
    for (_, dt, vals), h in zip(items, handles):
        out = hvd.synchronize(h)
        want = torch.from_numpy(vals.sum(axis=0)).to(getattr(torch, dt))
        wrong += int(out.dtype != want.dtype or not torch.equal(out, want))
        digest.update(out.view(torch.uint8).numpy().tobytes() if out.numel() else b"")
    return wrong


def _rounded_floats(hvd, torch, rank, size, rng, steps, digest, nelem=1000) -> float:
    """float32 sums that round: the worst distance from numpy's float64 sum."""
    worst = 0.0
    for step in range(0, steps, 10):
        vals = rng.standard_normal((10, size, nelem)).astype(np.float32)
        handles = [hvd.allreduce_async(torch.from_numpy(vals[i, rank].copy()), name=f"f{i}",
                                       op=hvd.Sum) for i in range(10)]
        for i, h in enumerate(handles):
            out = hvd.synchronize(h).numpy()
            digest.update(out.tobytes())
            worst = max(worst, float(np.abs(out - vals[i].astype(np.float64).sum(0)).max()))
    return worst


def soak(total, batch, seed, max_elems=4096, float_steps=300):
    """`total` fused allreduces (SUM) through horovod_spark.torch, in batches, then
    `float_steps` allreduces of random float32 (sums that round).

    Every rank draws the same batches, so it knows the exact answer: integer
    values whose sums every dtype represents exactly.  Returns digests of every
    result (equal on every rank iff the results are bit-identical), the number
    that differ from numpy, the worst float32 error, and the RSS after the first
    tenth and at the end of the exact part.
    """
    import hashlib

    import horovod_spark.torch as hvd
    import psutil
    import torch

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    rng, digest, wrong, rss = np.random.default_rng(seed), hashlib.sha256(), 0, []
    batches, fixed = total // batch, soak_shapes(seed, batch, max_elems)
    for b in range(batches):
        wrong += _exact_batch(hvd, torch, rank, soak_batch(rng, size, batch, max_elems, fixed),
                              digest)
        if b == batches // 10 or b == batches - 1:
            rss.append(psutil.Process().memory_info().rss)
    floats = hashlib.sha256()
    worst = _rounded_floats(hvd, torch, rank, size, rng, float_steps, floats)
    hvd.shutdown()
    return {"digest": digest.hexdigest(), "wrong": wrong, "count": batches * batch, "rss": rss,
            "float_digest": floats.hexdigest(), "float_worst": worst}


# --------------------------------------------------------------------------- restarts

def _epoch_data(epoch, rank, size, steps, batch):
    g = np.random.default_rng(1000 + epoch)
    x = g.standard_normal((size * steps * batch, 8)).astype(np.float32)
    w = np.arange(1, 9, dtype=np.float32)
    y = (x @ w + 0.5).reshape(-1, 1).astype(np.float32)
    mine = slice(rank * steps * batch, (rank + 1) * steps * batch)
    return x[mine], y[mine]


def train_with_checkpoints(ckpt_dir, epochs=4, steps=6, batch=16, die_rank=None, die_epoch=1,
                           die_step=3):
    """Horovod-style training that checkpoints every epoch and resumes from the newest.

    Rank 0 writes `ckpt_dir/ckpt.pt` (model, optimizer, next epoch) at the end of each
    epoch and loads it at start; broadcasts bring every rank to it.  `die_rank`
    SIGKILLs itself once (a marker file remembers) in epoch `die_epoch`.
    Returns the final weights (numpy) and the epoch this attempt started at.
    """
    import horovod_spark.torch as hvd
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    hvd.init()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    path, start = os.path.join(ckpt_dir, "ckpt.pt"), 0
    if hvd.rank() == 0 and os.path.exists(path):
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["epoch"])
    start = hvd.broadcast_object(start, root_rank=0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    dopt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    marker = os.path.join(ckpt_dir, "died-once")
    for epoch in range(start, epochs):
        x, y = _epoch_data(epoch, hvd.rank(), hvd.size(), steps, batch)
        for step in range(steps):
            if (hvd.rank() == die_rank and epoch == die_epoch and step == die_step
                    and not os.path.exists(marker)):
                open(marker, "w").close()
                die_now(ckpt_dir, hvd.rank(), f"epoch {epoch} step {step}")
            xb = torch.from_numpy(x[step * batch:(step + 1) * batch])
            yb = torch.from_numpy(y[step * batch:(step + 1) * batch])
            dopt.zero_grad()
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            dopt.step()
        if hvd.rank() == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch + 1},
                       path + ".tmp")
            os.replace(path + ".tmp", path)
        hvd.barrier()
    weights = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    hvd.shutdown()
    return {"weights": weights, "started_at": start}


# --------------------------------------------------------------------------- bad input

def refused_then_paired():
    """Rank 0 passes a bad tensor; then every rank allreduces: nothing went on the wire."""
    import collectives

    comm = collectives.init()
    refused = None
    if comm.rank == 0:
        try:
            comm.allreduce(np.ones(3, np.complex64))
        except TypeError as exc:
            refused = str(exc)
    out = comm.allreduce(np.full(5, comm.rank + 1.0, np.float32))
    return refused, out.tolist()


def fused_mismatch(kind):
    """Rank 0 and the others submit 'grad.w' with another shape or dtype to the fusion engine."""
    import collectives
    from collectives.fusion import FusionEngine

    comm = collectives.init()
    engine = FusionEngine(comm)
    n = 10 if comm.rank == 0 or kind == "dtype" else 12
    dtype = np.float32 if comm.rank == 0 or kind == "shape" else np.float64
    try:
        engine.submit("grad.w", "allreduce", np.ones(n, dtype)).wait(60)
    except collectives.MismatchError as exc:
        return str(exc)
    finally:
        engine.shutdown()
    return "no error"


def plain_mismatch():
    """A Communicator allreduce of 10 elements on rank 0 and 12 on the others."""
    import collectives

    comm = collectives.init()
    n = 10 if comm.rank == 0 else 12
    try:
        return "no error: " + str(comm.allreduce(np.ones(n, np.float32)).tolist())
    except collectives.MismatchError as exc:
        return str(exc)


cloudpickle.register_pickle_by_value(__import__(__name__))
