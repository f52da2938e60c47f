"""torch.distributed training code as users write it, run by the tests as every rank.

Each function builds a tiny model from a seed, trains a few steps on data made from the
seed and the rank, and returns what the tests compare: the weights (as lists), the step
count, and the torchrun variables the rank saw.  `expected_ddp_weights` trains the same
model in one process on every rank's data at once, which DDP's averaged gradients must
match.  A *victim* dies by SIGKILL at a step of the first attempt
(TORCHELASTIC_RESTART_COUNT 0), to test a restart from a checkpoint.

Pickled by value (see the bottom): executors cannot import this module.
"""
from __future__ import annotations

import os
import signal
import sys

import cloudpickle

TORCHRUN = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
            "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
            "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")
IN, OUT, BATCH = 8, 2, 16


def torchrun_env() -> dict:
    return {k: os.environ.get(k) for k in TORCHRUN}


def _model(seed: int = 0):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, 16), torch.nn.Tanh(), torch.nn.Linear(16, OUT))


def _batch(rank: int, step: int):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, IN, generator=g)
    return x, x[:, :OUT] * 2.0 - 1.0


def _dataset():
    """64 rows: the first batches of four ranks, one data set every rank shards."""
    import torch

    batches = [_batch(r, 0) for r in range(4)]
    return torch.utils.data.TensorDataset(torch.cat([x for x, _ in batches]),
                                          torch.cat([y for _, y in batches]))


def _weights(module) -> dict:
    return {k: v.detach().flatten().tolist() for k, v in module.state_dict().items()}


def ddp_steps(steps: int = 3, lr: float = 0.1, fail_rank=None, fail_step=None):
    """DistributedDataParallel, as the DDP tutorial writes it; rank `fail_rank` raises
    inside backward at `fail_step` (its peers are then inside an allreduce)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(_model())
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        x, y = _batch(rank, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        if rank == fail_rank and step == fail_step:
            loss = _exploding(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.destroy_process_group()
    return {"weights": _weights(model.module), "env": torchrun_env()}


def _exploding(loss):
    """`loss`, whose backward raises (torch is imported in the rank, so built here)."""
    import torch

    class Explode(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise ValueError(f"a bad batch on rank {os.environ['RANK']} in backward")

    return Explode.apply(loss)


def expected_ddp_weights(world: int, steps: int = 3, lr: float = 0.1) -> dict:
    """What DDP over `world` ranks must end with: one process, every rank's batch, the mean
    of the ranks' mean losses (DDP averages the ranks' gradients)."""
    import torch

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        losses = [torch.nn.functional.mse_loss(model(x), y)
                  for x, y in (_batch(r, step) for r in range(world))]
        opt.zero_grad()
        (sum(losses) / world).backward()
        opt.step()
    return _weights(model)


def fsdp2_steps(steps: int = 3, lr: float = 0.1):
    """FSDP2 (`fully_shard`), each Linear and the root sharded; the full weights back."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        x, y = _batch(rank, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    full = {k: v.full_tensor().flatten().tolist() for k, v in model.state_dict().items()}
    dist.destroy_process_group()
    return {"weights": full, "env": torchrun_env()}


def _die_if_victim(step: int, victim, die_at) -> None:
    if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and int(os.environ["RANK"]) == victim \
            and step == die_at:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def lightning_fit(ckpt_dir: str, epochs: int = 2, victim=None, die_at=None) -> dict:
    """Lightning's Trainer with strategy="ddp" on the ranks the job started (no spawning),
    checkpointing every step and resuming from the last checkpoint when there is one."""
    import lightning as L
    import torch

    class Regressor(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _model()

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Victim(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            _die_if_victim(trainer.global_step, victim, die_at)

    data = _dataset()
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_last=True,
                                                      every_n_train_steps=1)
    trainer = L.Trainer(accelerator="cpu", strategy="ddp",
                        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                        num_nodes=int(os.environ["GROUP_WORLD_SIZE"]), max_epochs=epochs,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[checkpoints, Victim()])
    model = Regressor()
    last = os.path.join(ckpt_dir, "last.ckpt")
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8),
                ckpt_path=last if os.path.exists(last) else None)
    return {"steps": trainer.global_step, "rank": trainer.global_rank,
            "world": trainer.world_size, "weights": _weights(model.net), "env": torchrun_env()}


def hf_train(out_dir: str, victim=None, die_at=None) -> dict:
    """Hugging Face's Trainer on a 2-layer BERT built from its config, on random tokens;
    a checkpoint every step, resumed from when there is one."""
    import torch
    import transformers
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    transformers.logging.set_verbosity_error()
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32, num_labels=2)
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)

    class Tokens(torch.utils.data.Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(1)
            self.x = torch.randint(0, 64, (64, 16), generator=g)
            self.y = torch.randint(0, 2, (64,), generator=g)

        def __len__(self):
            return len(self.y)

        def __getitem__(self, i):
            return {"input_ids": self.x[i], "labels": self.y[i]}

    class Victim(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            _die_if_victim(state.global_step, victim, die_at)

    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=4, num_train_epochs=1,
                             use_cpu=True, report_to=[], save_strategy="steps", save_steps=1,
                             logging_steps=1000, disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[Victim()])
    resume = transformers.trainer_utils.get_last_checkpoint(out_dir) if os.path.isdir(out_dir) \
        else None
    trainer.train(resume_from_checkpoint=resume)
    import torch.distributed as dist

    return {"steps": trainer.state.global_step, "rank": dist.get_rank(),
            "world": dist.get_world_size(), "mode": str(args.parallel_mode),
            "resumed": resume is not None, "env": torchrun_env()}


def accelerate_loop() -> dict:
    """accelerate's Accelerator around a plain loop."""
    import torch
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = _dataset()
    model, opt, loader = acc.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=8))
    steps = 0
    for x, y in loader:
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
        steps += 1
    return {"steps": steps, "rank": acc.process_index, "world": acc.num_processes,
            "type": str(acc.distributed_type), "weights": _weights(acc.unwrap_model(model))}


cloudpickle.register_pickle_by_value(sys.modules[__name__])
