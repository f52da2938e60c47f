"""np < 0: ranks on the driver machine through collectives.launch, no Spark tasks."""
from __future__ import annotations

import io
import threading

import numpy as np
import pytest

from _spark_support import by_value

import horovod_spark
from horovod_spark import HorovodRunner, JobFailedError

by_value(__name__)
pytestmark = pytest.mark.timeout(120)


def test_horovod_runner_with_negative_np_runs_ranks_locally_and_returns_rank_0s_value(capsys):
    def main(scale):
        import os
        import numpy as np
        import collectives
        comm = collectives.init()
        total = comm.allreduce(np.full(3, comm.rank + 1.0))
        print(f"rank {comm.rank} of {comm.size}", flush=True)
        comm.close()
        return {"rank": comm.rank, "total": total * scale, "spark": "SPARK_ENV_LOADED" in os.environ}

    value = HorovodRunner(np=-2).run(main, scale=2)
    assert value["rank"] == 0 and not value["spark"]
    np.testing.assert_array_equal(value["total"], [6.0, 6.0, 6.0])
    shown = capsys.readouterr().out
    assert "[0]<stdout>:rank 0 of 2" in shown and "[1]<stdout>:rank 1 of 2" in shown


def test_run_with_negative_num_proc_returns_every_value_and_adds_env():
    def read(x):
        import os
        return int(os.environ["HVS_RANK"]) + x, os.environ["MY_SETTING"]

    out = io.StringIO()
    assert horovod_spark.run(read, args=(10,), num_proc=-3, env={"MY_SETTING": "a"},
                             stdout=out) == [(10, "a"), (11, "a"), (12, "a")]


def test_a_failing_local_rank_is_raised_as_job_failed_error_naming_it():
    def fails():
        import os
        if os.environ["HVS_RANK"] == "1":
            raise ValueError("bad shard")
        return 0

    with pytest.raises(JobFailedError, match=r"rank 1/2: ValueError: bad shard") as info:
        horovod_spark.run(fails, num_proc=-2, stdout=io.StringIO(), stderr=io.StringIO())
    tb = info.value.remote_traceback
    assert 'raise ValueError("bad shard")' in tb
    # the traceback starts at the job's function: the launch's frames around it are left out
    frames = [line for line in tb.splitlines() if line.startswith("  File ")]
    assert len(frames) == 1 and frames[0].endswith("in fails"), tb
    assert isinstance(info.value.original(), ValueError)


def test_max_restarts_reruns_local_ranks_too(tmp_path):
    def fails_once(flag_dir):
        import os
        flag = os.path.join(flag_dir, "failed")
        if os.environ["HVS_RANK"] == "0" and not os.path.exists(flag):
            open(flag, "w").close()
            os._exit(5)
        return 1

    err = io.StringIO()
    assert horovod_spark.run(fails_once, args=(str(tmp_path),), num_proc=-2, max_restarts=2,
                             stdout=io.StringIO(), stderr=err) == [1, 1]
    assert "attempt 1/3 failed" in err.getvalue()


def test_an_unpicklable_function_is_refused_before_any_rank_starts():
    lock = threading.Lock()
    with pytest.raises(TypeError, match=r"closure variable 'lock'\) is a _thread.lock"):
        HorovodRunner(np=-2).run(lambda: lock.locked())


@pytest.mark.parametrize("kwargs,error,text", [
    ({"np": 0}, ValueError, "np=0 runs no rank"),
    ({"np": 2, "driver_log_verbosity": "loud"}, ValueError, "'all' or 'log_callback_only'"),
])
def test_horovod_runner_refuses_bad_arguments_at_the_call(kwargs, error, text):
    with pytest.raises(error, match=text):
        HorovodRunner(**kwargs)


@pytest.mark.parametrize("kwargs,text", [
    ({"max_restarts": -1}, "max_restarts must be an int >= 0"),
    ({"start_timeout": 0}, "start_timeout must be > 0"),
    ({"env": ["A=1"]}, "env must be a mapping"),
    ({"extra_mpi_args": "-x FOO"}, "not MPI"),
])
def test_run_refuses_bad_arguments_at_the_call(kwargs, text):
    with pytest.raises((ValueError, TypeError), match=text):
        horovod_spark.run(lambda: 0, num_proc=-1, **kwargs)
