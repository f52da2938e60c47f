"""horovod_spark.TorchDistributor, a drop-in for pyspark's: the same calls, values and refusals.

pyspark's own examples run after the import line changes; every argument pyspark refuses
is refused with pyspark's exception and text (both classes are called side by side here);
and a rank that raises inside DDP's backward is named, with its traceback, while its peers
wait in Gloo's allreduce, and nothing of the job is left behind.
"""
from __future__ import annotations

import os
import sys
import textwrap

import cloudpickle
import psutil
import pytest

import _torchdist_programs as programs
from horovod_spark import JobFailedError, TorchDistributor

pytest.importorskip("torch")
cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]


def train(learning_rate, use_gpu=False):
    """pyspark's docstring example, on CPUs (backend gloo)."""
    import torch
    import torch.distributed
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.distributed.init_process_group(backend="gloo")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=learning_rate)
    loss = model(torch.ones(8, 4)).pow(2).mean()
    loss.backward()
    opt.step()
    torch.distributed.destroy_process_group()
    return model.module  # or anything else


SCRIPT = textwrap.dedent("""
    import argparse, json, os
    import torch.distributed as dist
    p = argparse.ArgumentParser()
    p.add_argument("--learning-rate", type=float)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--out")
    a = p.parse_args()
    dist.init_process_group("gloo")
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (a.learning_rate, a.batch_size, os.environ["RANK"]))
    if dist.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump(seen, f)
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("local_mode", [True, False])
def test_pysparks_examples_run_after_the_import_swap(spark, tmp_path, local_mode):
    import json

    import torch

    distributor = TorchDistributor(num_processes=2, local_mode=local_mode, use_gpu=False)
    model = distributor.run(train, 1e-3)
    assert isinstance(model, torch.nn.Linear)
    script, out = tmp_path / "train.py", tmp_path / "seen.json"
    script.write_text(SCRIPT)
    assert distributor.run(str(script), "--learning-rate=1e-3", "--batch-size=64",
                           f"--out={out}") is None
    assert json.loads(out.read_text()) == [[1e-3, 64, "0"], [1e-3, 64, "1"]]


def test_each_task_is_a_node_of_one_process_as_under_pysparks(spark):
    envs = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(_every_env)
    assert [e["RANK"] for e in envs] == ["0", "1"]
    assert [(e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) for e in envs] == [("0", "1")] * 2
    assert [(e["GROUP_RANK"], e["GROUP_WORLD_SIZE"]) for e in envs] == [("0", "2"), ("1", "2")]
    assert {e["CUDA_VISIBLE_DEVICES"] for e in envs} == {""}  # use_gpu=False hides every GPU


def _every_env():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    mine = {**programs.torchrun_env(), "CUDA_VISIBLE_DEVICES": os.environ["CUDA_VISIBLE_DEVICES"]}
    envs = [None] * dist.get_world_size()
    dist.all_gather_object(envs, mine)
    dist.destroy_process_group()
    return envs


def _refusal(cls, kwargs, run=None):
    try:
        distributor = cls(**kwargs)
        if run is not None:
            distributor.run(*run[0], **run[1])
    except Exception as exc:  # the refusal under comparison
        return type(exc).__name__, " ".join(str(exc).split())
    return None


def test_every_refusal_is_pysparks_word_for_word(spark, tmp_path):
    from pyspark.ml.torch.distributor import TorchDistributor as Pyspark

    script = tmp_path / "x.py"
    script.write_text("pass\n")
    cases = [({"num_processes": 0, "use_gpu": False}, None),
             ({"num_processes": -2, "local_mode": False, "use_gpu": False}, None),
             ({}, None),  # use_gpu and local_mode by default: no GPU on this driver
             ({"num_processes": 2, "local_mode": False}, None),  # no spark.task.resource.gpu
             ({"num_processes": 2, "use_gpu": False},
              ((str(script),), {"lr": 1})),  # a script takes no keyword arguments (pyspark's
             ]                               # says so in local mode; on a cluster its task fails)
    for kwargs, run in cases:
        theirs = _refusal(Pyspark, kwargs, run)
        assert theirs is not None, kwargs
        assert _refusal(TorchDistributor, kwargs, run) == theirs, kwargs
    spark.conf.set("spark.ssl.enabled", "true")
    try:
        run = ((str(script),), {})
        kwargs = {"num_processes": 2, "local_mode": False, "use_gpu": False}
        theirs = _refusal(Pyspark, kwargs, run)
        assert theirs is not None and "TLS encryption" in theirs[1]
        assert _refusal(TorchDistributor, kwargs, run) == theirs
    finally:
        spark.conf.unset("spark.ssl.enabled")


@pytest.mark.timeout(60)  # named within 60 s, or the test fails
def test_a_rank_that_raises_in_ddp_backward_is_named_and_nothing_is_left(spark):
    tag = f"torchdist-{os.getpid()}-{id(spark)}"
    segments = set(os.listdir("/dev/shm"))
    distributor = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False,
                                   env={"HVS_TEST_TAG": tag, "HOROVOD_SPARK_WARM_START": "0"})
    with pytest.raises(JobFailedError) as info:
        distributor.run(programs.ddp_steps, steps=50, fail_rank=1, fail_step=2)
    err = info.value
    assert isinstance(err, RuntimeError)  # what pyspark's raises, so except clauses still work
    assert err.rank == 1 and err.error_type == "ValueError", err
    assert "a bad batch on rank 1 in backward" in str(err)
    assert "--- traceback of rank 1 ---" in str(err) and "backward" in err.remote_traceback
    assert _gone(tag) == [], "processes of the failed job are left"
    assert set(os.listdir("/dev/shm")) - segments == set(), "shared-memory segments are left"


def _gone(tag: str, seconds: float = 15.0) -> list:
    """The processes carrying `tag` still alive after `seconds` (expected: none)."""
    import time

    deadline = time.monotonic() + seconds
    while True:
        found = []
        for p in psutil.process_iter():
            try:
                if p.environ().get("HVS_TEST_TAG") == tag and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p.pid)
            except psutil.Error:
                pass
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_a_local_mode_failure_names_the_rank_not_the_peers_gloo_error(tmp_path):
    distributor = TorchDistributor(num_processes=3, local_mode=True, use_gpu=False)
    with pytest.raises(JobFailedError) as info:
        distributor.run(programs.ddp_steps, steps=50, fail_rank=2, fail_step=1)
    assert info.value.rank == 2 and info.value.error_type == "ValueError", info.value


def test_ddp_jobs_that_destroy_their_group_all_finish_on_warm_ranks(spark):
    """Six jobs in a row, the later ones forked warm: each destroys its process group, then
    frees its DDP model.  With torch._dynamo preloaded in the zygote, torch 2.13 deadlocked
    in about one such job in three (the ProcessGroupGloo destructor joins its worker with the
    GIL held, and the worker waits for the GIL)."""
    distributor = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, verbose=0,
                                   env={"HOROVOD_SPARK_FINISH_GRACE_SECONDS": "30"})
    for _ in range(6):
        assert distributor.run(programs.ddp_steps, steps=3)["env"]["WORLD_SIZE"] == "2"
