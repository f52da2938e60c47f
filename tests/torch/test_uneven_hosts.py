"""Hosts with different numbers of ranks (placement 2+1) train with the default optimizer.

Every choice that must match across ranks (here: the DistributedOptimizer's
bucket layout) is made once for the world.  Each rank's threads make its host
look crowded (2 ranks x all cores) or not (1 rank x 1 thread), as hosts with
different cores or placements do; were the layout chosen per rank, the ranks
would submit different bucket names and wait for each other for ever.
"""
from __future__ import annotations

import pytest

from collectives.launch import run_local


def _train(steps: int):
    import hashlib

    import torch

    import horovod_spark.torch as hvd
    from collectives.backends.native import usable_cores

    hvd.init()
    torch.set_num_threads(usable_cores() if hvd.local_size() > 1 else 1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    torch.manual_seed(1 + hvd.rank())
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 16)).square().mean().backward()
        opt.step()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    return digest.hexdigest(), sorted(b.name for b in opt._buckets)


@pytest.mark.timeout(180)
def test_placement_two_plus_one_trains_with_the_default_optimizer():
    per_rank = run_local(_train, 3, args=(4,), hosts=["a", "a", "b"], timeout=90,
                         env={"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    layouts = [layout for _, layout in per_rank]
    assert layouts[0] == layouts[1] == layouts[2], layouts
    assert len({digest for digest, _ in per_rank}) == 1
