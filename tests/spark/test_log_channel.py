"""The log channel on real sockets: lines, failures, aborts, and that it never fails a job."""
from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import threading

import pytest

import _spark_support  # noqa: F401  (puts the repository on sys.path)
from collectives.launch.record import Failure

from horovod_spark._job.logchannel import CALLBACK_MARK, LineSink, LogClient, LogServer
from horovod_spark._job.markers import failure_marker, marked_failure, parse_failure_markers

SECRET = os.urandom(32)
JOB = "hvs-test/a0"
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server():
    out, err = io.StringIO(), io.StringIO()
    srv = LogServer("127.0.0.1", SECRET, JOB, LineSink(out, err))
    srv.out, srv.err = out, err
    yield srv
    srv.close()


def test_lines_from_two_ranks_reach_the_driver_prefixed_by_rank(server):
    clients = [LogClient(server.address, SECRET, JOB, rank) for rank in (0, 1)]
    for rank, client in enumerate(clients):
        client.line("stdout", f"loss 0.{rank}")
        client.line("stderr", f"warn {rank}")
    for client in clients:
        client.close()
    assert server.wait_done([0, 1], 10)
    assert sorted(server.out.getvalue().splitlines()) == ["[0]<stdout>:loss 0.0", "[1]<stdout>:loss 0.1"]
    assert sorted(server.err.getvalue().splitlines()) == ["[0]<stderr>:warn 0", "[1]<stderr>:warn 1"]


def test_a_client_without_the_secret_is_dropped_before_any_frame_is_read(server):
    intruder = LogClient(server.address, os.urandom(32), JOB, 0)
    intruder.line("stdout", "forged line")
    intruder.close()
    assert server.wait(lambda: server.rejected == 1, 10)
    assert server.out.getvalue() == ""
    assert intruder.broken


def test_a_client_of_another_job_is_dropped(server):
    stale = LogClient(server.address, SECRET, "hvs-test/a1", 0)
    stale.line("stdout", "from an old attempt")
    stale.close()
    assert server.wait(lambda: server.rejected == 1, 10)
    assert server.out.getvalue() == ""


def test_garbage_on_the_port_never_stops_the_server(server):
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as raw:
        raw.sendall(b"GET / HTTP/1.0\r\n\r\n" * 100)
    good = LogClient(server.address, SECRET, JOB, 0)
    good.line("stdout", "still here")
    good.close()
    assert server.wait_done([0], 10)
    assert server.out.getvalue() == "[0]<stdout>:still here\n"


def test_a_client_of_an_unreachable_driver_drops_lines_and_never_raises():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = "127.0.0.1:%d" % s.getsockname()[1]
    client = LogClient(dead, SECRET, JOB, 0, connect_timeout=1.0)
    for i in range(100):
        client.line("stdout", f"line {i}")
    client.failure({"rank": 0})
    client.close(timeout=5.0)
    assert client.broken and client.dropped >= 1


def test_a_driver_that_goes_away_mid_job_never_fails_the_client(server):
    client = LogClient(server.address, SECRET, JOB, 0)
    client.line("stdout", "before")
    assert server.wait(lambda: "before" in server.out.getvalue(), 10)
    server.close()
    for i in range(2000):
        client.line("stdout", "x" * 100)
    client.close(timeout=5.0)


def test_a_failing_output_stream_on_the_driver_is_ignored():
    class Broken(io.TextIOBase):
        def write(self, text):
            raise OSError("closed")

    LineSink(Broken(), Broken()).write(0, "stdout", "dropped quietly")


def test_failure_records_and_the_abort_frame_travel_both_ways(server):
    aborted = threading.Event()
    client = LogClient(server.address, SECRET, JOB, 1, on_abort=aborted.set)
    client.failure({"rank": 1, "error_type": "ValueError"})
    assert server.wait(lambda: server.failures, 10)
    assert server.failures == [{"rank": 1, "error_type": "ValueError"}]
    server.abort_all()
    assert aborted.wait(10)
    client.close()


def test_log_callback_only_lines_are_callback_stream_lines(server):
    server.sink.show_output = False
    client = LogClient(server.address, SECRET, JOB, 0)
    client.line("stdout", "hidden")
    client.line("cb", "shown")
    client.close()
    assert server.wait_done([0], 10)
    assert server.out.getvalue() == "[0]<stdout>:shown\n"


def test_log_to_driver_marks_its_lines_only_under_a_spark_task():
    code = "from horovod_spark import log_to_driver; log_to_driver('epoch 1\\nepoch 2')"
    env = dict(os.environ, PYTHONPATH=_spark_support.REPO, HVS_LOG_CALLBACK="1")
    marked = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert marked.stdout == f"{CALLBACK_MARK}epoch 1\n{CALLBACK_MARK}epoch 2\n"
    env.pop("HVS_LOG_CALLBACK")
    plain = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert plain.stdout == "epoch 1\nepoch 2\n"


def test_a_failure_record_survives_a_trip_through_exception_text():
    record = {"rank": 2, "message": "boom \u2603\nsecond line", "tail": ["[2]<stdout>:x"]}
    text = f"Py4JJavaError: ... RankFailure: rank 2\n{failure_marker(record)}\n\tat org.apache..."
    assert parse_failure_markers(text) == [record]
    assert parse_failure_markers("no markers here") == []


# What precedes a task's exception in Spark's text: the stage's headline and the Python
# worker's frames of the task, with the paths of a site-packages install.
_SITE = "/local_disk0/.ephemeral_nfs/envs/pythonEnv-0123/lib/python3.11/site-packages"
SPARK_PREFIX = (
    "(org.apache.spark.SparkException) Job aborted due to stage failure: Could not recover from "
    "a failed barrier ResultStage. Most recent failure reason: Stage failed because barrier task "
    "ResultTask(12, 1) finished unsuccessfully.\norg.apache.spark.api.python.PythonException: "
    "[PYTHON_EXCEPTION] An exception was thrown from the Python worker: Traceback (most recent "
    "call last):\n" + "".join(f'  File "{_SITE}/horovod_spark/_job/{f}", line 318, in {fn}\n'
                              f"    {code}\n" for f, fn, code in [
                                  ("cluster.py", "_arrow_body", "for row in task(iter(())):"),
                                  ("task.py", "run_task", "proc.cleanup()"),
                                  ("task.py", "outcome", "self._fail(self._failure(rc, result))"),
                                  ("task.py", "_fail", "raise marked_failure(failure)")])
    + "collectives.launch.procs.RankFailed: ")


@pytest.mark.parametrize("message", ["bad learning rate -1", "bad learning rate -1 " + "x" * 3000])
def test_a_failure_cut_to_the_first_2_kb_still_names_its_error_traceback_and_last_output(message):
    """A Connect client before pyspark 4 receives only the first 2 KB of an exception's text,
    Spark's prefix and the task's frames included; the rank's traceback and output are long."""
    tb = "".join(f'  File "{_SITE}/mylib/train.py", line {i}, in step\n    work({i})\n'
                 for i in range(200))
    failure = Failure(1, "ValueError", message, size=2, host="10.0.0.17", exitcode=1, time=5.0,
                      traceback="Traceback (most recent call last):\n" + tb +
                      '    raise ValueError("bad learning rate -1")\nValueError: ' + message + "\n",
                      tail=tuple(f"[1]<stdout>:step {i} loss {i * 0.01:.4f} " + "=" * 60
                                 for i in range(100)) + ("[1]<stdout>:about to fail",),
                      hint="lower it", exc_blob=b"pickled")
    text = SPARK_PREFIX + str(marked_failure(failure))
    record = dict(failure.to_dict(), exc_blob=None)
    record.pop("exc_blob")
    assert parse_failure_markers(text) == [record]  # the whole record wins over its compact twin
    (cut,) = parse_failure_markers(text[:2048])
    assert (cut["rank"], cut["error_type"], cut["host"], cut["size"]) == (1, "ValueError",
                                                                         "10.0.0.17", 2)
    assert cut["message"].startswith("bad learning rate -1")
    assert 'raise ValueError("bad learning rate -1")' in cut["traceback"]
    assert cut["tail"][-1] == "[1]<stdout>:about to fail"
    assert str(marked_failure(failure)).startswith("rank 1 failed") == (len(message) < 100)


def test_a_closed_server_stops_listening_and_its_threads_end():
    srv = LogServer("127.0.0.1", SECRET, JOB, LineSink(io.StringIO(), io.StringIO()))
    before = {t for t in threading.enumerate() if t.name == "hvs-log-accept"}
    host, port = srv.address.rsplit(":", 1)
    srv.close()
    for t in before:
        t.join(5)
    assert not any(t.is_alive() for t in before)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(port)), timeout=5).close()
