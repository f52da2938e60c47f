"""The elastic tests' training: a torch linear model on generated data, deterministic per step.

Step s uses one global batch of GLOBAL rows drawn from seed s; rank r of n takes rows
[r*GLOBAL/n, (r+1)*GLOBAL/n), so the averaged gradient is the global batch's whatever the
world size, and a single process computes the same training (`reference`).
"""
from __future__ import annotations

GLOBAL, FEATURES, LR, MOMENTUM = 8, 4, 0.05, 0.9


def global_batch(step: int):
    import torch

    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL, FEATURES, generator=gen, dtype=torch.float64)
    w = torch.arange(1, FEATURES + 1, dtype=torch.float64).unsqueeze(1)
    return x, x @ w + 0.5 + 0.01 * torch.randn(GLOBAL, 1, generator=gen, dtype=torch.float64)


def new_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, 1).double()


def train(steps: int, commit_every: int, kill_at=None, marker=None, victim: int = 1,
          kill="rank", pause: float = 0.0, grow_to=None):
    """Every rank's (first step of this attempt, world size, weights, optimizer momentum,
    the world sizes the reset callback saw).  `kill_at`: after that step of the first attempt
    (the marker file says it happened), the victim rank SIGKILLs itself ("rank") or its
    executor's JVM ("executor").  `pause`: seconds after each step.  `grow_to`: after the
    last step, commit every 0.25 s (at most 480 times) until the world has that many ranks
    (the driver grows it at a commit when Spark offers the slots)."""
    import os
    import time

    import torch

    import horovod_spark.torch as hvd

    hvd.init()
    model = new_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)
    resets = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])

    @hvd.elastic.run
    def loop(state):
        first = state.step
        while state.step < steps:
            x, y = global_batch(state.step)
            n, r = hvd.size(), hvd.rank()
            lo, hi = r * GLOBAL // n, (r + 1) * GLOBAL // n
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi]).backward()
            opt.step()
            state.step += 1
            if state.step % commit_every == 0:
                state.commit()
            if state.step == kill_at and r == victim and not os.path.exists(marker):
                open(marker, "w").close()
                _die(kill)
            time.sleep(pause)
        for _ in range(480 if grow_to else 0):  # a count, not a clock: every rank stops alike
            if hvd.size() >= grow_to:
                break
            time.sleep(0.25)
            state.commit()
        momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
        return first, hvd.size(), [p.detach().clone() for p in model.parameters()], momentum, \
            resets

    return loop(state)


def _die(what: str) -> None:
    import os
    import signal

    import psutil

    if what == "executor":  # the JVM above this rank (its task's worker's daemon's parent)
        for proc in psutil.Process().parents():
            if "CoarseGrainedExecutorBackend" in " ".join(proc.cmdline()):
                os.kill(proc.pid, signal.SIGKILL)
                break
        else:
            raise RuntimeError("no executor JVM above this rank")
    os.kill(os.getpid(), signal.SIGKILL)


def reference(steps: int):
    """The same training in one process: the weights after `steps` steps."""
    import torch

    model = new_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(steps):
        x, y = global_batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def sample_epochs(samples: int, epochs: int, batch: int, outdir: str, kill_after=None,
                  marker=None):
    """Horovod's ElasticSampler in a TorchState: each rank appends the indices it processed
    (attempt, epoch, index) to a file, commits after every batch; rank 1 of the first attempt
    SIGKILLs itself after `kill_after` batches of epoch 1.  Returns (world size, first epoch
    of this attempt, the sampler's processed count at the start)."""
    import os
    import signal

    import torch

    import horovod_spark.torch as hvd

    hvd.init()
    data = list(range(samples))
    sampler = hvd.elastic.ElasticSampler(data, shuffle=True, seed=3)
    state = hvd.elastic.TorchState(sampler=sampler, epoch=0, batches=0)

    @hvd.elastic.run
    def loop(state):
        start = (hvd.size(), state.epoch, state.sampler.processed_num)
        attempt = 1 if marker and os.path.exists(marker) else 0
        log = os.path.join(outdir, f"rank{hvd.rank()}-attempt{attempt}")
        loader = torch.utils.data.DataLoader(data, batch_size=batch, sampler=state.sampler)
        while state.epoch < epochs:
            for i, indices in enumerate(loader):
                hvd.allreduce(torch.ones(1), name="step")  # the world's step: then it counts
                with open(log, "a") as f:
                    f.write("".join(f"{state.epoch} {int(x)}\n" for x in indices))
                state.sampler.record_batch(i, batch)
                state.batches += 1
                state.commit()
                if kill_after and state.epoch == 1 and i + 1 == kill_after and \
                        hvd.rank() == 1 and not os.path.exists(marker):
                    open(marker, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()
        return start

    return loop(state)
