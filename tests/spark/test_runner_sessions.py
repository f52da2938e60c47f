"""The runner written once, run on a classic local[2] session and on a Spark Connect one.

The Connect session is a client of a real local Spark Connect server (a JVM and Python
workers of its own: tests/connect_server.py); the test process is put in the user's
Connect mode while a Connect test runs, so `HorovodRunner` and `run` find the Connect
session as a notebook on a Connect cluster would.  `unreachable` is a Connect client
whose executors cannot reach it (HOROVOD_SPARK_CLIENT_ADDRESS=none): the ranks meet at
rank 0's task store and output and failures come back with the stage.
"""
from __future__ import annotations

import contextlib
import io

import pytest

from _spark_support import (by_value, new_tag, start_session, stop_session,
                            wait_until_no_rank_processes)
from connect_server import connect_mode

import horovod_spark
from horovod_spark import HorovodRunner, JobFailedError

by_value(__name__)
pytestmark = [pytest.mark.spark, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def classic():
    session = start_session("local[2]")
    yield session
    stop_session(session)


@pytest.fixture(params=["classic", "connect", "unreachable"])
def session(request, classic, monkeypatch):
    """Which session the runner finds: the classic one, or the Connect client."""
    if request.param == "classic":
        yield "classic"
        return
    server = request.getfixturevalue("connect_server")
    server.session()
    if request.param == "unreachable":
        monkeypatch.setenv("HOROVOD_SPARK_CLIENT_ADDRESS", "none")
    with connect_mode():
        from pyspark.sql import SparkSession

        assert type(SparkSession.getActiveSession()).__module__.startswith("pyspark.sql.connect")
        yield request.param


def rank_and_value(x):
    import os
    return int(os.environ["HVS_RANK"]) * x


def test_values_come_back_in_rank_order_and_a_collective_runs(session):
    def allreduce(x):
        import numpy as np
        import collectives
        comm = collectives.init()
        total = comm.allreduce(np.full(4, comm.rank + x, dtype=np.float32))
        comm.close()
        return comm.rank, total.tolist()

    assert horovod_spark.run(allreduce, args=(1,), num_proc=2) == [(0, [3.0] * 4), (1, [3.0] * 4)]
    assert horovod_spark.run(rank_and_value, args=(10,)) == [0, 10]  # num_proc: 2 slots
    assert HorovodRunner(np=2).run(rank_and_value, x=5) == 0


def test_a_value_error_on_rank_1_is_named_with_its_traceback(session):
    def fails_on_rank_1():
        import os
        import time
        if os.environ["HVS_RANK"] == "1":
            print("about to fail", flush=True)
            raise ValueError("bad learning rate -1")
        time.sleep(60)  # rank 0 must be killed, not waited for

    tag = new_tag()
    with pytest.raises(JobFailedError) as info:
        horovod_spark.run(fails_on_rank_1, num_proc=2, env={"HVS_TEST_TAG": tag})
    err = info.value
    assert (err.rank, err.size, err.error_type) == (1, 2, "ValueError")
    assert "bad learning rate -1" in str(err) and "rank 1/2" in str(err)
    assert 'raise ValueError("bad learning rate -1")' in err.remote_traceback
    assert "[1]<stdout>:about to fail" in err.output_tail
    assert "see the executor's log" not in str(err)
    assert wait_until_no_rank_processes(tag) == []


def test_a_sigkilled_rank_is_named_with_its_signal(session):
    def killed_on_rank_0():
        import os
        import signal
        import time
        if os.environ["HVS_RANK"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)

    tag = new_tag()
    with pytest.raises(JobFailedError, match=r"rank 0/2: ProcessDied: .*SIGKILL") as info:
        horovod_spark.run(killed_on_rank_0, num_proc=2, env={"HVS_TEST_TAG": tag})
    assert info.value.signal == "SIGKILL"
    assert wait_until_no_rank_processes(tag) == []


def test_np_larger_than_the_slots_fails_before_submitting_saying_what_to_change(session):
    with pytest.raises(ValueError, match=r"np=3 ranks need 3 barrier task slots, but the "
                                         r"cluster has 2.*run with np=2"):
        horovod_spark.run(rank_and_value, args=(1,), num_proc=3)


def test_output_and_progress_reach_the_client(session):
    def chatty():
        import os
        import sys
        from horovod_spark import log_to_driver
        rank = os.environ["HVS_RANK"]
        print(f"hello from rank {rank}", flush=True)
        print(f"warning from rank {rank}", file=sys.stderr, flush=True)
        log_to_driver(f"callback from rank {rank}")
        return rank

    out, err = io.StringIO(), io.StringIO()
    assert horovod_spark.run(chatty, num_proc=2, stdout=out, stderr=err) == ["0", "1"]
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:hello from rank {rank}\n" in out.getvalue()
        assert f"[{rank}]<stderr>:warning from rank {rank}\n" in err.getvalue()
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        HorovodRunner(np=2, verbose=0).run(chatty)
    assert "callback from rank 0" in shown.getvalue() and "hello from" not in shown.getvalue()


def test_the_progress_bar_runs_to_the_end_on_the_client(session, capsys):
    def steps():
        from horovod_spark import progress
        for step in range(3):
            progress.report(epoch=0, epochs=1, step=step, steps=3, samples=8)
        return True

    assert horovod_spark.run(steps, num_proc=2) == [True, True]
    err = capsys.readouterr().err
    assert "epoch 1/1: 100%" in err and "3/3" in err


def test_the_cli_runs_a_script_on_a_connect_server(connect_server, tmp_path):
    import os
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text("import os\nprint('rank', os.environ['HVS_RANK'], 'of', "
                      "os.environ['HOROVOD_SIZE'], flush=True)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED")}
    env["PYTHONPATH"] = os.pathsep.join([connect_server_repo(), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "horovod_spark.cli", "run", "--np", "2",
                           "--remote", connect_server.url, str(script)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[0]<stdout>:rank 0 of 2" in done.stdout and "[1]<stdout>:rank 1 of 2" in done.stdout


def connect_server_repo():
    from connect_server import REPO
    return REPO
