"""DeepSpeed programs unchanged on the job's ranks, and pyspark's DeepspeedTorchDistributor's
face: a real DeepSpeed engine (ZeRO stage 1, CPU accelerator, gloo) trains a tiny model on
every rank, its parameters the same bits everywhere; a script gets --deepspeed and
--deepspeed_config as under pyspark's; a failing rank is named with its traceback."""
from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

import _programs as programs

deepspeed = pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.timeout(300)]
HERE = os.path.dirname(os.path.abspath(__file__))


def _cpu_env():
    return {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}


def test_deepspeed_initialize_trains_on_every_rank_of_a_local_job_alike():
    import horovod_spark

    results = horovod_spark.run(programs.ds_all_ranks, num_proc=-2, env=_cpu_env())
    assert [r["rank"] for r in results] == [0, 1] and {r["world"] for r in results} == {2}
    assert {r["backend"] for r in results} == {"gloo"}
    np.testing.assert_array_equal(results[0]["params"], results[1]["params"])  # synced bits
    for r in results:
        assert r["losses"][-1] < r["losses"][0], r["losses"]


def test_the_distributor_hands_a_function_its_config_and_returns_rank_0s_value():
    from horovod_spark import DeepspeedTorchDistributor

    dist = DeepspeedTorchDistributor(numGpus=2, nnodes=1, localMode=True, useGpu=False,
                                     deepspeedConfig=programs.DS_CONFIG, env=_cpu_env())
    value = dist.run(programs.ds_function)
    assert value["rank"] == 0 and value["world"] == 2
    assert value["losses"][-1] < value["losses"][0]


def test_a_script_gets_deepspeed_and_its_config_file_after_its_own_arguments(tmp_path):
    from horovod_spark import DeepspeedTorchDistributor

    script, config = tmp_path / "train.py", tmp_path / "ds.json"
    script.write_text(programs.DS_SCRIPT)
    config.write_text(json.dumps(programs.DS_CONFIG))
    out = tmp_path / "result"
    dist = DeepspeedTorchDistributor(numGpus=2, localMode=True, useGpu=False,
                                     deepspeedConfig=str(config),
                                     env=dict(_cpu_env(), DS_PROGRAMS=HERE))
    assert dist.run(str(script), "--out", str(out)) is None
    results = [json.loads((tmp_path / f"result.{r}").read_text()) for r in (0, 1)]
    for r in results:
        assert r["deepspeed"] is True
        argv = r["argv"]
        assert argv[:3] == ["--out", str(out), "--deepspeed"] and argv[3] == "--deepspeed_config"
        assert not os.path.exists(argv[4])  # the rank's own copy, removed after
    np.testing.assert_array_equal(results[0]["params"], results[1]["params"])


def test_bad_arguments_are_refused_as_pyspark_refuses_them(tmp_path):
    from horovod_spark import DeepspeedTorchDistributor

    with pytest.raises(ValueError, match="numGpus has to be a positive integer"):
        DeepspeedTorchDistributor(numGpus=0, useGpu=False)
    with pytest.raises(ValueError, match="cannot be read on the driver"):
        DeepspeedTorchDistributor(useGpu=False, deepspeedConfig=str(tmp_path / "none.json"))
    dist = DeepspeedTorchDistributor(useGpu=False)
    with pytest.raises(ValueError, match="doesn't support keyword arguments"):
        dist.run(str(tmp_path / "x.py"), lr=1)


def test_a_rank_that_raises_is_named_and_its_peer_is_torn_down():
    from horovod_spark import DeepspeedTorchDistributor, JobFailedError

    t0 = time.monotonic()
    with pytest.raises(JobFailedError) as info:
        DeepspeedTorchDistributor(numGpus=2, localMode=True, useGpu=False,
                                  env=_cpu_env()).run(programs.ds_fails_on_rank_1)
    assert info.value.rank == 1 and "ValueError: rank 1 has no data" in str(info.value)
    assert "ds_fails_on_rank_1" in str(info.value)  # its traceback
    assert time.monotonic() - t0 < 120


@pytest.mark.spark
def test_on_spark_the_distributor_runs_a_task_a_rank(spark):
    from horovod_spark import DeepspeedTorchDistributor

    value = DeepspeedTorchDistributor(numGpus=1, nnodes=2, localMode=False, useGpu=False,
                                      deepspeedConfig=programs.DS_CONFIG,
                                      env=_cpu_env()).run(programs.ds_function)
    assert value["world"] == 2 and value["losses"][-1] < value["losses"][0]
