"""The frameworks people train with, on a job's Spark ranks (local[2]), as their docs write them.

DDP and FSDP2 end with the weights one process reaches on every rank's data; Lightning's
Trainer(strategy="ddp") and Hugging Face's Trainer run on the job's ranks without spawning
processes of their own, and, with `max_restarts=1`, resume from their last checkpoint after
a rank is killed and end with the uninterrupted run's step count; accelerate's Accelerator
runs its loop across the ranks.  Tiny models built from config, random data, nothing
downloaded.
"""
from __future__ import annotations

import contextlib
import io
import sys

import cloudpickle
import numpy as np
import pytest

import _torchdist_programs as programs
from horovod_spark import TorchDistributor

pytest.importorskip("torch")
cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(300)]


def _distributor(**kw):
    return TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, verbose=0, **kw)


def _assert_weights(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for name, values in expected.items():
        np.testing.assert_allclose(got[name], values, rtol=1e-5, atol=1e-6, err_msg=name)


def test_ddp_ends_with_the_weights_of_one_process_on_every_ranks_data(spark):
    got = _distributor().run(programs.ddp_steps, steps=3)
    _assert_weights(got["weights"], programs.expected_ddp_weights(2, steps=3))


def test_fsdp2_fully_shard_ends_with_ddps_weights(spark):
    got = _distributor().run(programs.fsdp2_steps, steps=3)
    _assert_weights(got["weights"], programs.expected_ddp_weights(2, steps=3))


def test_lightning_trainer_with_ddp_trains_on_the_jobs_ranks(spark, tmp_path):
    pytest.importorskip("lightning")
    got = _distributor().run(programs.lightning_fit, str(tmp_path / "ckpt"), epochs=2)
    assert (got["rank"], got["world"], got["steps"]) == (0, 2, 8)  # 64 rows, 8 a batch, 2 ranks


def test_lightning_resumes_from_its_last_checkpoint_after_a_rank_is_killed(spark, tmp_path):
    pytest.importorskip("lightning")
    said = io.StringIO()  # where the driver says that it restarts
    with contextlib.redirect_stderr(said):
        got = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False,
                               max_restarts=1).run(programs.lightning_fit, str(tmp_path / "ckpt"),
                                                   epochs=2, victim=1, die_at=3)
    assert got["steps"] == 8 and got["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"
    assert "attempt 1/2 failed (ProcessDied on rank 1); restarting" in said.getvalue()


def test_hugging_face_trainer_trains_and_resumes_after_a_rank_is_killed(spark, tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    whole = _distributor().run(programs.hf_train, str(tmp_path / "whole"))
    assert (whole["rank"], whole["world"], whole["steps"]) == (0, 2, 8)
    assert whole["mode"] == "ParallelMode.DISTRIBUTED" and not whole["resumed"]
    resumed = _distributor(max_restarts=1).run(programs.hf_train, str(tmp_path / "cut"),
                                               victim=1, die_at=3)
    assert resumed["steps"] == whole["steps"] and resumed["resumed"]
    assert resumed["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"


def test_accelerate_runs_its_loop_across_the_ranks(spark):
    pytest.importorskip("accelerate")
    got = _distributor().run(programs.accelerate_loop)
    assert (got["rank"], got["world"], got["steps"]) == (0, 2, 4)
    assert got["type"] == "DistributedType.MULTI_CPU"
