"""The progress display: records from real ranks, one bar on the driver, never a failure.

In-process checks drive `report` and `Display` directly; the job checks run
real ranks (local processes, and Spark barrier tasks on local[2]) and read the
bar where a user sees it, on the driver's stderr.
"""
import io
import json
import sys

import cloudpickle
import pytest

from _kernel import REPO  # noqa: E402

if REPO not in sys.path:
    sys.path.insert(0, REPO)

import horovod_spark  # noqa: E402
from horovod_spark import progress  # noqa: E402
from horovod_spark.progress import rank as progress_rank  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # executors can't import tests/


def _records(text: str) -> list:
    return [json.loads(line.split(progress.PROGRESS_MARK, 1)[1]) for line in text.split("\n")
            if progress.PROGRESS_MARK in line]


# --------------------------------------------------------------------------- rank side

@pytest.fixture
def rank_env(monkeypatch):
    monkeypatch.setenv("HVS_PROGRESS", "1")
    monkeypatch.setenv("HVS_RANK", "3")
    monkeypatch.delenv("HVS_LOG_CALLBACK", raising=False)
    monkeypatch.setattr(progress_rank, "_totals", None)


def test_report_writes_nothing_unless_the_driver_asked_for_progress(monkeypatch, capfd):
    monkeypatch.delenv("HVS_PROGRESS", raising=False)
    monkeypatch.setattr(progress_rank, "_totals", None)
    progress.report(epoch=0, step=0, steps=1, samples=8)
    assert capfd.readouterr().out == ""


def test_report_writes_cumulative_records_and_always_the_last_step_of_an_epoch(rank_env, capfd,
                                                                               monkeypatch):
    monkeypatch.setattr(progress_rank, "MIN_INTERVAL", 3600.0)  # only the first and the last are due
    for step in range(10):
        progress.report(epoch=0, epochs=2, step=step, steps=10, samples=4, allreduce_time=0.5,
                        loss=1.0 / (step + 1))
    recs = _records(capfd.readouterr().out)
    assert [r["step"] for r in recs] == [1, 10]
    last = recs[-1]
    assert (last["rank"], last["done"], last["samples"], last["allreduce_s"]) == (3, 10, 40, 5.0)
    assert (last["epoch"], last["epochs"], last["steps"], last["loss"]) == (0, 2, 10, 0.1)


def test_report_refuses_what_is_not_a_count(rank_env):
    with pytest.raises(TypeError, match="samples must be an int, got str"):
        progress.report(samples="64")
    with pytest.raises(ValueError, match="step must be >= 0, got -1"):
        progress.report(step=-1)
    with pytest.raises(TypeError, match="loss must be a number, got list"):
        progress.report(loss=[1.0])


# --------------------------------------------------------------------------- driver side

def _line(rank, t, samples, allreduce_s, **position):
    rec = dict(rank=rank, t=t, done=1, samples=samples, allreduce_s=allreduce_s, **position)
    return f"[{rank}]<stdout>:{progress.PROGRESS_MARK}{json.dumps(rec)}\n"


def test_the_display_adds_up_every_ranks_samples_and_averages_their_allreduce_share():
    bar, lines = io.StringIO(), io.StringIO()
    display = progress.Display(file=bar)
    stream = display.stream(lines)
    for rank in (0, 1):
        stream.write(_line(rank, 1.0, 100, 0.1, epoch=0, epochs=2, step=5, steps=10))
        stream.write(_line(rank, 3.0, 500 + 100 * rank, 0.5 + 0.2 * rank, epoch=0, epochs=2,
                           step=10, steps=10))
    samples, share = display.rates()
    assert samples == pytest.approx(400 / 2 + 500 / 2)   # rank 0: 400 in 2 s, rank 1: 500 in 2 s
    assert share == pytest.approx((0.4 / 2 + 0.6 / 2) / 2)
    display.close()
    assert lines.getvalue() == "", "records must not reach the rank output"
    assert "epoch 1/2" in bar.getvalue() and "10/20" in bar.getvalue()
    assert "450 samples/s" in bar.getvalue() and "allreduce 25%" in bar.getvalue()


def _steady(stream, ranks=2, batch=8, seconds=4.0, every=0.5):
    """Records of ranks stepping together: one step of `batch` samples every `every` s."""
    for i in range(1, int(seconds / every) + 1):
        for rank in range(ranks):
            rec = dict(rank=rank, t=i * every, done=i, samples=i * batch, allreduce_s=0.0,
                       epoch=0, epochs=1, step=i, steps=100)
            stream.write(f"[{rank}]<stdout>:{progress.PROGRESS_MARK}{json.dumps(rec)}\n")


def test_off_a_terminal_the_display_writes_plain_lines_whose_numbers_agree():
    out = io.StringIO()
    display = progress.Display(file=out)
    _steady(display.stream(io.StringIO()))
    display.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) == 2, lines  # the first record, the end
    # 2 steps/s on each of 2 ranks at 8 samples a step: 32 samples/s
    assert lines[-1] == "epoch 1/1: 8% 8/100 steps, 2 step/s, 32 samples/s, allreduce 0%"


def test_on_a_terminal_the_bar_shows_step_s_and_samples_s_from_one_window():
    import fcntl
    import os
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))  # a real width
    with os.fdopen(slave, "w") as tty:
        display = progress.Display(file=tty)
        _steady(display.stream(io.StringIO()))
        display.close()
    text = os.read(master, 65536).decode()
    os.close(master)
    assert "\r" in text and "8/100 [" in text
    assert "2 step/s, 32 samples/s" in text.rstrip().split("\r")[-1], text[-300:]


def test_lines_pass_through_and_a_broken_record_is_dropped_without_an_error():
    lines = io.StringIO()
    display = progress.Display(file=io.StringIO())
    stream = display.stream(lines)
    stream.write("[0]<stdout>:hello\n")
    stream.write(f"[1]<stdout>:{progress.PROGRESS_MARK}{{not json\n")
    stream.write(f"[1]<stdout>:{progress.PROGRESS_MARK}" + json.dumps({"rank": "x"}) + "\n")
    stream.write(f"[0]<stdout>:half a line{progress.PROGRESS_MARK}" +
                 json.dumps(dict(rank=0, t=1, done=1, samples=1, allreduce_s=0)) + "\n")
    display.close()
    assert lines.getvalue() == "[0]<stdout>:hello\n[0]<stdout>:half a line\n"
    assert (display.dropped, display.records) == (2, 1)


# --------------------------------------------------------------------------- real jobs

def _train(epochs=2, steps=6, explicit=True, fail=False):
    import os

    import torch

    import horovod_spark.torch as hvd
    from horovod_spark import progress as p

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for epoch in range(epochs):
        for step in range(steps):
            opt.zero_grad()
            model(torch.ones(8, 4)).sum().backward()
            opt.step()
            if explicit:
                p.report(epoch=epoch, epochs=epochs, step=step, steps=steps, samples=8)
    print("last words", flush=True)
    if fail:
        raise RuntimeError("boom")
    return os.environ.get("HVS_PROGRESS")


def test_local_ranks_drive_one_bar_to_the_end(capsys):
    pytest.importorskip("torch")
    assert horovod_spark.run(_train, num_proc=-2) == ["1", "1"]
    err = capsys.readouterr().err
    assert "epoch 2/2: 100%" in err and "12/12" in err and "samples/s" in err


def test_the_step_hook_counts_distributed_optimizer_steps_without_report(capsys):
    pytest.importorskip("torch")
    horovod_spark.run(_train, kwargs={"explicit": False}, num_proc=-2)
    err = capsys.readouterr().err
    assert "12 steps" in err and "allreduce" in err


def test_verbose_0_shows_no_bar_and_asks_the_ranks_for_no_records(capsys):
    pytest.importorskip("torch")
    assert horovod_spark.run(_train, num_proc=-2, verbose=0) == [None, None]
    assert progress.PROGRESS_MARK not in capsys.readouterr().err


def test_a_record_survives_splitlines_whole():
    line = f"[0]<stdout>:{progress.PROGRESS_MARK}{{}}\n"
    assert len(line.splitlines()) == 1


def test_a_failing_rank_s_last_output_has_no_progress_records():
    pytest.importorskip("torch")
    with pytest.raises(horovod_spark.JobFailedError) as info:
        horovod_spark.run(_train, kwargs={"fail": True}, num_proc=-2)
    assert "last words" in info.value.output_tail
    assert progress.PROGRESS_MARK not in str(info.value)


@pytest.fixture(scope="module")
def spark():
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        yield active
        return
    session = (SparkSession.builder.master("local[2]").appName("horovod-spark-progress-tests")
               .config("spark.pyspark.python", sys.executable)
               .config("spark.executorEnv.PYTHONPATH", REPO)
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.mark.spark
def test_spark_ranks_reach_the_bar_through_the_log_channel_whatever_the_verbosity(spark, capsys):
    pytest.importorskip("torch")
    runner = horovod_spark.HorovodRunner(np=2)  # log_callback_only: only log_to_driver lines
    assert runner.run(_train) == "1"
    captured = capsys.readouterr()
    assert "epoch 2/2: 100%" in captured.err and "12/12" in captured.err
    assert progress.PROGRESS_MARK not in captured.out + captured.err
    assert "last words" not in captured.out
