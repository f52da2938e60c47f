"""Ranks on separate executor JVMs (local-cluster[2,1,1024]) with fake GPU discovery."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from _spark_support import (by_value, new_tag, start_session, stop_session,
                            wait_until_no_rank_processes, write_gpu_script)

import _elastic_training as training
import horovod_spark
from horovod_spark import JobFailedError

by_value(__name__)
by_value("_elastic_training")
pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def spark(tmp_path_factory):
    script = write_gpu_script(str(tmp_path_factory.mktemp("gpus")))
    conf = {
        "spark.worker.resource.gpu.amount": "1",
        "spark.worker.resource.gpu.discoveryScript": script,
        "spark.executor.resource.gpu.amount": "1",
        "spark.task.resource.gpu.amount": "1",
        "spark.executor.memory": "512m",
    }
    session = start_session("local-cluster[2,1,1024]", conf)
    yield session
    stop_session(session, conf)


def test_each_rank_sees_its_hosts_gpus_in_local_rank_order_with_its_own_at_local_rank(spark):
    """Horovod's torch.cuda.set_device(hvd.local_rank()) lands on the rank's own GPU."""
    def devices():
        import os

        import psutil
        return (os.environ["CUDA_VISIBLE_DEVICES"], int(os.environ["HVS_GPU_ORDINAL"]),
                int(os.environ["HOROVOD_LOCAL_RANK"]), os.environ["CUDA_DEVICE_ORDER"],
                psutil.Process(os.getppid()).ppid())  # the task: the keeper's parent

    (vis0, ord0, lr0, order, task0), (vis1, ord1, lr1, _, task1) = \
        horovod_spark.run(devices, num_proc=2)
    assert task0 != task1  # two tasks, one per executor, on this one host
    assert vis0 == vis1 and sorted(vis0.split(",")) == ["0", "1"]
    assert (ord0, ord1) == (lr0, lr1) == (0, 1)
    own = [vis0.split(",")[ord0], vis1.split(",")[ord1]]
    assert sorted(own) == ["0", "1"] and order == "PCI_BUS_ID"  # a GPU each, none shared


def test_ranks_on_two_executors_allreduce_like_numpy(spark):
    def train():
        import numpy as np
        import collectives
        comm = collectives.init()
        grads = np.random.default_rng(comm.rank).standard_normal(4097).astype(np.float64)
        mean = comm.allreduce(grads) / comm.size
        comm.close()
        return grads, mean

    (g0, m0), (g1, m1) = horovod_spark.run(train, num_proc=2)
    np.testing.assert_allclose(m0, (g0 + g1) / 2, rtol=1e-12)
    np.testing.assert_array_equal(m0, m1)


def test_a_sigkilled_rank_is_named_and_no_rank_is_left_on_any_executor(spark):
    def killed_on_rank_1():
        import os
        import signal
        import numpy as np
        import collectives
        comm = collectives.init()
        if comm.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        comm.allreduce(np.ones(8))  # rank 0 loses its peer here
        comm.allreduce(np.ones(8))

    tag = new_tag()
    with pytest.raises(JobFailedError, match="rank 1/2: ProcessDied: .*SIGKILL") as info:
        horovod_spark.run(killed_on_rank_1, num_proc=2, env={"HVS_TEST_TAG": tag})
    assert info.value.signal == "SIGKILL" and info.value.rank == 1
    assert wait_until_no_rank_processes(tag) == []


def test_more_ranks_than_gpu_slots_fail_at_once_naming_the_gpus(spark):
    with pytest.raises(ValueError, match=r"np=3 ranks need 3 barrier task slots.*1 GPU\(s\) "
                                         r"per executor, 1 per task.*run with np=2"):
        horovod_spark.run(lambda: 0, num_proc=3)


def test_ranks_with_gpus_never_fork_from_a_zygote(spark):
    """A CUDA context must not cross a fork: GPU tasks start their ranks fresh, always."""
    def with_torch():
        import os

        import psutil
        import torch  # noqa: F401  (the module a zygote would preload)
        return "collectives.launch.zygote" in " ".join(psutil.Process(os.getppid()).cmdline())

    assert horovod_spark.run(with_torch, num_proc=2) == [False, False]
    assert horovod_spark.run(with_torch, num_proc=2) == [False, False]


def test_an_executor_killed_mid_training_shrinks_the_world_and_new_slots_grow_it_again(
        spark, tmp_path, capfd):
    """SIGKILL of rank 1's executor JVM after step 7: the next attempt starts from the commit
    at step 6 with the slots there are then (1, until Spark's Worker has started a new
    executor); once the new executor is there the driver offers its slot, every rank raises
    HostsUpdatedInterrupt at its next commit, and the last attempt has 2 ranks again, from
    that commit: the same training as one process, no reset counted for the growth."""
    marker = str(tmp_path / "killed")
    out = horovod_spark.run_elastic(training.train,
                                    args=(10, 3, 7, marker, 1, "executor", 0.2, 2),
                                    num_proc=2, min_num_proc=1, max_num_proc=2, reset_limit=1,
                                    verbose=1)
    said = capfd.readouterr().err
    first, size, _, _, resets = out[0]
    assert size == 2 and len(out) == 2 and all(r[:2] + (r[4],) == out[0][:2] + (resets,)
                                               for r in out)
    assert resets == [2]  # the last attempt's callback, on its world
    if first > 6:  # the usual case: the attempt after the loss had 1 rank, then grew
        assert "elastic job: attempt 1 (2 ranks): rank 1" in said, said
        assert "1 ranks: growing to 2 at the next commit" in said, said
        assert "attempt 2 (1 ranks) ended at a commit to grow" in said, said
        assert first in (9, 10), first  # a commit of the 1-rank attempt
    else:  # the new executor was up before the next attempt began: no growth to see
        assert first == 6 and "grow" not in said, said
    for got, want in zip(out[0][2], training.reference(10)):  # the same training, one process
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
