"""A DDP training script as the PyTorch tutorial writes it: nothing of horovod_spark in it.

    python _ddp_script.py OUT_JSON [STEPS]

Rank 0 writes the trained weights to OUT_JSON.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 8, generator=g)
    return x, x[:, :2] * 2.0 - 1.0


def main():
    out, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3
    dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = batch(rank, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    if rank == 0:
        weights = {k: v.flatten().tolist() for k, v in net.state_dict().items()}
        with open(out, "w") as f:
            json.dump({"weights": weights, "world": dist.get_world_size(),
                       "local_rank": os.environ["LOCAL_RANK"]}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
