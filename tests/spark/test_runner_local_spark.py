"""HorovodRunner and run() on a real local[2] Spark session: results, output, failures."""
from __future__ import annotations

import io

import numpy as np
import pytest

from _spark_support import (by_value, new_tag, start_session, stop_session,
                            wait_until_no_rank_processes)

import horovod_spark
from horovod_spark import HorovodRunner, JobFailedError

by_value(__name__)
pytestmark = [pytest.mark.spark, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def spark():
    conf = {"spark.driver.maxResultSize": "1m"}
    session = start_session("local[2]", conf)
    yield session
    stop_session(session, conf)


def rank_and_value(x):
    import os
    return int(os.environ["HVS_RANK"]) * x


def test_run_returns_every_ranks_value_in_rank_order(spark):
    assert horovod_spark.run(rank_and_value, args=(10,), num_proc=2) == [0, 10]


def test_num_proc_defaults_to_the_default_parallelism(spark):
    assert horovod_spark.run(rank_and_value, kwargs={"x": 1}) == [0, 1]


def test_horovod_runner_returns_rank_0s_value_and_passes_kwargs(spark):
    def main(scale, offset):
        import os
        return {"rank": int(os.environ["HVS_RANK"]) * scale + offset,
                "size": int(os.environ["HOROVOD_SIZE"])}

    assert HorovodRunner(np=2).run(main, scale=5, offset=1) == {"rank": 1, "size": 2}


def test_every_line_of_every_rank_reaches_the_driver_prefixed_by_rank(spark):
    def chatty():
        import os
        import sys
        rank = os.environ["HVS_RANK"]
        for i in range(3):
            print(f"line {i} of rank {rank}", flush=True)
        print(f"warning from rank {rank}", file=sys.stderr, flush=True)

    out, err = io.StringIO(), io.StringIO()
    horovod_spark.run(chatty, num_proc=2, stdout=out, stderr=err)
    for rank in (0, 1):
        for i in range(3):
            assert f"[{rank}]<stdout>:line {i} of rank {rank}\n" in out.getvalue()
        assert f"[{rank}]<stderr>:warning from rank {rank}\n" in err.getvalue()
    assert "<stderr>" not in out.getvalue()


def test_log_callback_only_shows_only_what_ranks_log_to_the_driver(spark, capsys):
    def main():
        import os
        from horovod_spark import log_to_driver
        print("noise that stays on the executor", flush=True)
        log_to_driver(f"epoch 1 done on rank {os.environ['HVS_RANK']}")

    HorovodRunner(np=2).run(main)
    shown = capsys.readouterr().out
    assert "[0]<stdout>:epoch 1 done on rank 0" in shown
    assert "[1]<stdout>:epoch 1 done on rank 1" in shown
    assert "noise" not in shown


def test_driver_log_verbosity_all_shows_every_line(spark, capsys):
    def main():
        print("every line", flush=True)

    HorovodRunner(np=2, driver_log_verbosity="all").run(main)
    shown = capsys.readouterr().out
    assert "[0]<stdout>:every line" in shown and "[1]<stdout>:every line" in shown


def test_env_is_added_to_every_ranks_environment_and_no_gpu_is_claimed(spark):
    def read_env():
        import os
        return os.environ["MY_SETTING"], os.environ.get("CUDA_VISIBLE_DEVICES")

    assert horovod_spark.run(read_env, num_proc=2, env={"MY_SETTING": "42"}) == [("42", None)] * 2


def test_log_level_info_sends_how_each_rank_joined_to_the_driver(spark):
    def join():
        import horovod_spark.torch as hvd
        hvd.init()
        hvd.shutdown()

    outs = []
    for env in ({}, {"HOROVOD_LOG_LEVEL": "INFO"}):
        out, err = io.StringIO(), io.StringIO()
        horovod_spark.run(join, num_proc=2, env=env, stdout=out, stderr=err)
        outs.append(out.getvalue())
    quiet, loud = outs
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:horovod_spark.torch joined as rank {rank}/2" in loud, loud
    assert "joined as rank" not in quiet, quiet


def test_a_collective_inside_the_function_matches_numpy(spark):
    def train():
        import numpy as np
        import collectives
        comm = collectives.init()
        x = np.arange(1000, dtype=np.float32) * (comm.rank + 1)
        total = comm.allreduce(x)
        second = collectives.init()  # a second communicator bootstraps through the same store
        gathered = second.allgather(np.full(comm.rank + 1, comm.rank, dtype=np.int64))
        comm.close()
        second.close()
        return total, gathered

    results = horovod_spark.run(train, num_proc=2)
    expected = np.arange(1000, dtype=np.float32) * 3
    for total, gathered in results:
        np.testing.assert_array_equal(total, expected)
        np.testing.assert_array_equal(gathered, [0, 1, 1])


def test_an_exception_in_rank_1_is_raised_on_the_driver_naming_rank_1(spark):
    def fails_on_rank_1():
        import os
        import time
        if os.environ["HVS_RANK"] == "1":
            print("about to fail", flush=True)
            raise KeyError("no such column 'label'")
        time.sleep(60)  # rank 0 must be killed, not waited for

    tag = new_tag()
    with pytest.raises(JobFailedError) as info:
        horovod_spark.run(fails_on_rank_1, num_proc=2, env={"HVS_TEST_TAG": tag})
    err = info.value
    assert (err.rank, err.size, err.error_type) == (1, 2, "KeyError")
    assert "no such column 'label'" in str(err) and "rank 1/2" in str(err)
    assert 'raise KeyError("no such column' in err.remote_traceback
    assert "[1]<stdout>:about to fail" in err.output_tail
    assert isinstance(err.original(), KeyError)
    assert wait_until_no_rank_processes(tag) == []


def test_os_exit_3_in_a_rank_is_named_with_its_exit_status(spark):
    def exits_on_rank_0():
        import os
        import time
        if os.environ["HVS_RANK"] == "0":
            os._exit(3)
        time.sleep(60)

    tag = new_tag()
    with pytest.raises(JobFailedError, match="rank 0/2: ProcessExited: .* status 3") as info:
        horovod_spark.run(exits_on_rank_0, num_proc=2, env={"HVS_TEST_TAG": tag})
    assert info.value.exitcode == 3 and info.value.signal is None
    assert wait_until_no_rank_processes(tag) == []


def test_a_crashed_task_is_named_and_its_rank_process_dies_with_it(spark):
    def kills_its_task():
        import os
        import signal
        import time
        if os.environ["HVS_RANK"] == "1":  # the PySpark worker running rank 1's task: the
            with open(f"/proc/{os.getppid()}/stat") as f:  # parent of the rank's keeper
                worker = int(f.read().rsplit(")", 1)[1].split()[1])
            os.kill(worker, signal.SIGKILL)
        time.sleep(60)

    tag = new_tag()
    # Started fresh: a rank forked warm is the executor's zygote's child, so its parent would
    # be the zygote, not the worker (the zygote's own death is tests/spark/test_zygote.py's).
    env = {"HVS_TEST_TAG": tag, "HOROVOD_SPARK_WARM_START": "0"}
    with pytest.raises(JobFailedError, match=r"rank 1/2: SparkTaskFailed: .*Python worker exited "
                                             r"unexpectedly.*see the executor's log"):
        horovod_spark.run(kills_its_task, num_proc=2, env=env)
    assert wait_until_no_rank_processes(tag) == []


def test_max_restarts_reruns_every_rank_after_a_failure(spark, tmp_path):
    def fails_once(flag_dir):
        import os
        rank = int(os.environ["HVS_RANK"])
        flag = os.path.join(flag_dir, "failed-once")
        if rank == 1 and not os.path.exists(flag):
            open(flag, "w").close()
            raise RuntimeError("first attempt fails")
        return rank

    err = io.StringIO()
    assert horovod_spark.run(fails_once, args=(str(tmp_path),), num_proc=2, max_restarts=1,
                             stderr=err) == [0, 1]
    assert "attempt 1/2 failed (RuntimeError on rank 1); restarting" in err.getvalue()


def test_np_larger_than_the_slots_fails_before_submitting_saying_what_to_change(spark):
    with pytest.raises(ValueError, match=r"np=3 ranks need 3 barrier task slots, but the "
                                         r"cluster has 2 .*run with np=2"):
        horovod_spark.run(rank_and_value, args=(1,), num_proc=3)
    assert spark.sparkContext.statusTracker().getActiveJobsIds() == []


def test_a_result_over_max_result_size_fails_with_the_fix(spark):
    def big():
        return b"x" * (2 << 20)

    with pytest.raises(JobFailedError, match=r"ResultTooLarge: .* over "
                                             r"spark.driver.maxResultSize=1.0 MiB.*return its path"):
        horovod_spark.run(big, num_proc=2)


def test_a_failing_driver_output_stream_never_fails_the_job(spark):
    class Broken(io.TextIOBase):
        def write(self, text):
            raise OSError("the notebook went away")

    def noisy():
        print("a line nobody can show", flush=True)
        return 7

    assert horovod_spark.run(noisy, num_proc=2, stdout=Broken()) == [7, 7]


def test_use_mpi_on_spark_is_refused_with_the_alternative(spark):
    with pytest.raises(ValueError, match="horovod-spark run --mpi"):
        horovod_spark.run(rank_and_value, args=(1,), num_proc=2, use_mpi=True)


def seen_timeout():
    import os
    return os.environ.get("HOROVOD_SPARK_TIMEOUT")


def test_a_rank_side_variable_only_the_driver_has_is_named_by_rank_0s_task(spark, monkeypatch):
    # set after the session started: the executors' environment never gets it
    monkeypatch.setenv("HOROVOD_SPARK_TIMEOUT", "7")
    out = io.StringIO()
    assert horovod_spark.run(seen_timeout, num_proc=2, stdout=out) == [None, None]
    said = out.getvalue()
    assert said.count("HOROVOD_SPARK_TIMEOUT='7' from the driver's environment does "
                      "nothing") == 1, said  # once, from rank 0's task
    assert "rank 0 has no HOROVOD_SPARK_TIMEOUT" in said and "run(env=...)" in said
    out = io.StringIO()  # in the job's env it reaches the ranks, and nothing is said
    assert horovod_spark.run(seen_timeout, num_proc=2, stdout=out,
                             env={"HOROVOD_SPARK_TIMEOUT": "7"}) == ["7", "7"]
    assert "does nothing" not in out.getvalue()
