"""A Horovod-style training script, run as is under mpiexec: `import horovod_spark.torch as hvd`.

Every rank starts from different random weights (broadcast_parameters must
fix that), trains a small MLP on its shard of sklearn's digits with
DistributedOptimizer, and checks:

* rank, size and local rank come from MPI (and the backend is "mpi");
* with equal shards, averaged gradients equal the full batch's gradient, so
  the weights after training equal those of a one-process run on the whole
  batch, computed on this rank from the same start (float64, tight tolerance);
* every rank holds the same weights, and the loss went down.

Prints "MPI TRAIN OK rank r/n loss a -> b" and exits 0, or raises.
Usage: mpiexec -n N python _mpi_train.py [steps]
"""
from __future__ import annotations

import copy
import sys

import numpy as np
import torch
from sklearn.datasets import load_digits

import horovod_spark.torch as hvd


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 10)).double()


def _train(model, opt, x, y, steps: int) -> list:
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def main() -> int:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    hvd.init()
    from mpi4py import MPI

    rank, size = hvd.rank(), hvd.size()
    assert (rank, size) == (MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
    assert hvd.local_rank() == rank and hvd.local_size() == size
    from horovod_spark.torch import _state

    assert _state.communicator().backend_name == "mpi", _state.communicator().backend_name

    digits = load_digits()
    n = (len(digits.target) // (size * 8)) * size * 8 // 4  # equal shards, a few hundred rows
    x_all = torch.tensor(digits.data[:n] / 16.0, dtype=torch.float64)
    y_all = torch.tensor(digits.target[:n], dtype=torch.int64)
    shard = slice(rank * n // size, (rank + 1) * n // size)

    model = _model(seed=100 + rank)  # different on every rank until the broadcast
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    reference = copy.deepcopy(model)

    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters())
    losses = _train(model, opt, x_all[shard], y_all[shard], steps)
    _train(reference, torch.optim.SGD(reference.parameters(), lr=0.5), x_all, y_all, steps)

    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=1e-9, atol=1e-12), f"{name}: differs from the full-batch run"
        gathered = hvd.allgather(p.detach().reshape(1, -1), name=f"check.{name}")
        assert torch.equal(gathered, gathered[:1].expand_as(gathered)), f"{name}: ranks disagree"
    mean_loss = hvd.allreduce(torch.tensor(losses), name="check.losses")
    assert mean_loss[-1] < mean_loss[0], mean_loss
    print(f"MPI TRAIN OK rank {rank}/{size} loss {mean_loss[0]:.4f} -> {mean_loss[-1]:.4f}", flush=True)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
