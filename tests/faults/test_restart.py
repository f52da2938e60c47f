"""max_restarts: a job whose rank 1 dies once in epoch 2 resumes from its checkpoint and
finishes with exactly the weights of an undisturbed run."""
from __future__ import annotations

import os

import numpy as np
import pytest

import _fault_kit as kit
import _fault_work as work


def _run(np_, ckpt_dir, fault, die_rank, max_restarts):
    """horovod_spark.run of the checkpointing trainer: np_ > 0 on Spark, < 0 local ranks."""
    os.makedirs(ckpt_dir, exist_ok=True)
    return kit.run_spark_job(work.train_with_checkpoints, np_,
                             args=(str(ckpt_dir), 3, 4, 16, die_rank, 1, 2), env=fault.env(),
                             outdir=fault.outdir, max_restarts=max_restarts)


@pytest.mark.spark
@pytest.mark.slow
def test_spark_ranks_restart_from_the_checkpoint_and_end_with_the_undisturbed_weights(
        spark, tmp_path, fault):
    calm = _run(2, tmp_path / "calm", fault, None, 0)
    assert calm.error is None, calm.error
    hurt = _run(2, tmp_path / "hurt", fault, 1, 1)
    assert hurt.error is None, hurt.error
    assert kit.notes(tmp_path / "hurt", "killed")[1]["where"] == "epoch 1 step 2"
    assert [v["started_at"] for v in hurt.value] == [1, 1], "the second attempt did not resume"
    assert [v["started_at"] for v in calm.value] == [0, 0]
    for want, got in zip(calm.value, hurt.value):
        assert sorted(want["weights"]) == sorted(got["weights"])
        for name in want["weights"]:
            np.testing.assert_array_equal(got["weights"][name], want["weights"][name], err_msg=name)
    seconds, left = kit.wait_gone(fault.tag)
    assert not left, left

