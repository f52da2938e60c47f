"""A small CNN trained on CUDA with DistributedOptimizer (`import horovod_spark.torch as hvd`).

Run directly (a world of one) or as every rank of `python -m collectives.launch -n N`
with N GPUs.  Each rank trains on its shard of sklearn's digits (8x8 images);
averaged gradients of equal shards equal the full batch's, so the weights must
match a plain one-process run on the whole batch from the same start.
Prints "GPU CNN OK rank r/n loss a -> b" and exits 0, or raises.
"""
from __future__ import annotations

import copy
import os
import sys

import torch
from sklearn.datasets import load_digits

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import horovod_spark.torch as hvd  # noqa: E402


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(16 * 4 * 4, 10))


def _train(model, opt, x, y, steps):
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def main() -> int:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    if not torch.cuda.is_available():
        print(f"GPU CNN needs a CUDA GPU; torch {torch.__version__} sees none", flush=True)
        return 2
    # cuDNN convolutions default to TF32 on this GPU generation: a 10-bit mantissa, whose
    # rounding differs between a shard and the full batch far beyond the tolerance below.
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    hvd.init()
    torch.cuda.set_device(hvd.local_rank())
    dev = torch.device("cuda", hvd.local_rank())
    rank, size = hvd.rank(), hvd.size()
    d = load_digits()
    n = (len(d.target) // size) * size
    x = torch.tensor(d.data[:n] / 16.0, dtype=torch.float32, device=dev).reshape(-1, 1, 8, 8)
    y = torch.tensor(d.target[:n], device=dev)
    shard = slice(rank * n // size, (rank + 1) * n // size)
    model = _model().to(dev)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    reference = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    losses = _train(model, opt, x[shard], y[shard], steps)
    _train(reference, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9), x, y, steps)
    # Every rank applied the same averaged gradients: the weights agree bit for bit.
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ranks = hvd.allgather(flat.unsqueeze(0), name="cnn.weights")
    assert all(torch.equal(ranks[r], ranks[0]) for r in range(size)), \
        f"rank {rank}: the ranks' weights differ (max {(ranks - ranks[0]).abs().max().item():.3g})"
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        gap = (p - q).abs().max().item()
        assert p.is_cuda and torch.allclose(p, q, rtol=1e-4, atol=1e-5), \
            f"rank {rank}: {name} differs from one process on the full batch by up to {gap:.3g}"
    assert losses[-1] < losses[0], losses
    print(f"GPU CNN OK rank {rank}/{size} loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
