"""Warm starts on a real local[2] session: the second job's ranks fork from the workers' zygotes.

Every job here carries a fresh WARM_TEST_RUN value in its env, so its zygote
key is new to the session's Python workers: the first job of a key starts its
ranks fresh, the next ones fork them (horovod_spark._job.warm).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid

import psutil
import pyspark
import pytest

from _spark_support import (REPO, alive_after, by_value, fast_jvm_env, start_session,
                            stop_session, wait_until_no_rank_processes)

import horovod_spark
from horovod_spark import JobFailedError
from horovod_spark._job.cluster import Cluster

by_value(__name__)
pytestmark = [pytest.mark.spark, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def spark():
    session = start_session("local[2]")
    yield session
    stop_session(session)


def new_key() -> dict:
    return {"WARM_TEST_RUN": uuid.uuid4().hex}


def probe(note_dir=None):
    """What a rank finds at its start (before it imports anything), then one allreduce."""
    import os
    import random
    import sys

    import psutil
    preloaded = "torch" in sys.modules
    parent = " ".join(psutil.Process(os.getppid()).cmdline())
    import torch

    import horovod_spark.torch as hvd
    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
    return {"preloaded": preloaded, "forked": "collectives.launch.zygote" in parent,
            "pid": os.getpid(), "random": random.random(), "total": total,
            "value": os.environ.get("HVS_TEST_VALUE"), "rank": hvd.rank(),
            "sid": os.getsid(0), "keeper": os.getppid()}


def test_the_next_job_forks_its_ranks_from_a_zygote_with_torch_imported(spark):
    key = new_key()
    first = horovod_spark.run(probe, num_proc=2, env=dict(key, HVS_TEST_VALUE="a"))
    assert [r["forked"] for r in first] == [False, False]
    assert [r["total"] for r in first] == [3.0, 3.0]
    second = horovod_spark.run(probe, num_proc=2, env=dict(key, HVS_TEST_VALUE="b"))
    third = horovod_spark.run(probe, num_proc=2, env=dict(key, HVS_TEST_VALUE="c"))
    for job, value in ((second, "b"), (third, "c")):
        assert [r["forked"] for r in job] == [True, True]
        assert [r["preloaded"] for r in job] == [True, True]
        assert [r["total"] for r in job] == [3.0, 3.0]
        assert [r["rank"] for r in job] == [0, 1]
        assert [r["value"] for r in job] == [value, value]  # this job's env, not the zygote's
        assert all(r["sid"] == r["keeper"] for r in job)  # its keeper's session, as a fresh rank
    pids = [r["pid"] for job in (first, second, third) for r in job]
    assert len(set(pids)) == 6
    randoms = [r["random"] for job in (second, third) for r in job]
    assert len(set(randoms)) == 4, "forked ranks share the zygote's random state"


def python_workers() -> list:
    """This session's Python workers: the processes its Python daemons forked."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if "pyspark.daemon" in proc.cmdline() and "pyspark.daemon" in proc.parent().cmdline():
                found.append(proc)
        except psutil.Error:
            pass
    return found


def light_probe():
    """Whether this rank was forked with pyarrow imported (a zygote's lightest heavy module)."""
    import os
    import sys

    import psutil
    forked = "collectives.launch.zygote" in " ".join(psutil.Process(os.getppid()).cmdline())
    preloaded = "pyarrow" in sys.modules
    import pyarrow  # noqa: F401  (what the next job's zygote preloads)
    return forked and preloaded


@pytest.mark.skipif(pyspark.__version__ < "4", reason="pyspark 3.5 hands a task to an idle "
                    "Python worker without checking that it lives: one stopped here, outside "
                    "Spark, fails the next task with a broken pipe")
def test_ranks_fork_warm_in_arrow_workers_that_replaced_the_last_jobs(spark, monkeypatch):
    # Spark stops Python workers idle for a minute; the zygote is the executor's, not theirs.
    # The barrier mapInArrow stage Connect sessions run: its Arrow workers are not the RDD's.
    monkeypatch.setattr(Cluster, "classic_stage", "dataframe")
    key = new_key()
    assert horovod_spark.run(light_probe, num_proc=2, env=key) == [False, False]
    workers = python_workers()
    assert workers, "no Python worker found to stop"
    for worker in workers:
        worker.kill()
    assert alive_after([w.pid for w in workers]) == []
    assert horovod_spark.run(light_probe, num_proc=2, env=key) == [True, True]


def test_a_job_with_another_environment_starts_fresh(spark):
    key = new_key()
    horovod_spark.run(probe, num_proc=2, env=key)
    assert [r["forked"] for r in horovod_spark.run(probe, num_proc=2, env=key)] == [True, True]
    other = horovod_spark.run(probe, num_proc=2, env=dict(key, WARM_TEST_OTHER="1"))
    assert [r["forked"] for r in other] == [False, False]


def test_warm_start_is_off_with_horovod_spark_warm_start_0(spark, monkeypatch):
    key = new_key()
    horovod_spark.run(probe, num_proc=2, env=key)
    monkeypatch.setenv("HOROVOD_SPARK_WARM_START", "0")  # on the driver
    assert [r["forked"] for r in horovod_spark.run(probe, num_proc=2, env=key)] == [False, False]
    monkeypatch.delenv("HOROVOD_SPARK_WARM_START")
    assert [r["forked"] for r in horovod_spark.run(probe, num_proc=2, env=key)] == [True, True]


def fail_on_rank_1(how, note_dir):
    import os
    import signal
    import sys
    import time

    import psutil
    rank = int(os.environ["HVS_RANK"])
    forked = "collectives.launch.zygote" in " ".join(psutil.Process(os.getppid()).cmdline())
    with open(os.path.join(note_dir, f"rank{rank}"), "w") as f:
        f.write(f"{int(forked)} {os.getpid()}")
    if rank == 1:
        deadline = time.monotonic() + 60  # fail once rank 0 has written its note
        while not os.path.exists(os.path.join(note_dir, "rank0")) and time.monotonic() < deadline:
            time.sleep(0.01)
        if how == "exit":
            sys.stdout.flush()
            os._exit(7)
        if how == "signal":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError("rank 1 gives up")
    time.sleep(600)  # rank 0 waits until the job is aborted


@pytest.mark.parametrize("how,text", [
    ("exit", "exited with status 7"),
    ("signal", "killed by signal SIGKILL"),
    ("raise", "ValueError: rank 1 gives up"),
])
def test_a_forked_rank_that_fails_is_named_and_nothing_is_left(spark, tmp_path, how, text):
    key = new_key()
    horovod_spark.run(probe, num_proc=2, env=key)
    t0 = time.monotonic()
    with pytest.raises(JobFailedError, match=text) as info:
        horovod_spark.run(fail_on_rank_1, args=(how, str(tmp_path)), num_proc=2, env=key)
    assert "rank 1" in str(info.value)
    assert time.monotonic() - t0 < 120  # rank 0, asleep, was aborted, not waited for
    notes = {name: (tmp_path / name).read_text().split() for name in ("rank0", "rank1")}
    assert [notes[n][0] for n in ("rank0", "rank1")] == ["1", "1"], "the ranks were not forked"
    pids = [int(notes[n][1]) for n in notes]
    assert wait_until_no_rank_processes("no-tag") == []
    assert alive_after(pids) == []
    # Spark kills the Python worker of a killed task, not the executor's zygote: the next
    # job's ranks fork from it.
    again = horovod_spark.run(probe, num_proc=2, env=key)
    assert [r["total"] for r in again] == [3.0, 3.0]
    assert [r["forked"] for r in again] == [True, True]


DRIVER = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {tests!r})
    from _spark_support import start_session
    import horovod_spark

    def probe():
        import os, time, psutil
        return os.getpid(), psutil.Process(os.getppid()).ppid()  # the keeper's parent

    def sleeper(path):
        import os, time
        with open(os.path.join(path, str(os.environ["HVS_RANK"])), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(600)

    spark = start_session("local[2]")
    horovod_spark.run(probe, num_proc=2)
    zygotes = [z for _, z in horovod_spark.run(probe, num_proc=2)]
    print(" ".join(map(str, zygotes)), flush=True)
    horovod_spark.run(sleeper, args=({path!r},), num_proc=2)
""")


def test_a_killed_driver_leaves_no_zygote_and_no_forked_rank(tmp_path):
    """The chain: driver gone -> JVM -> Python workers -> their zygotes -> forked ranks."""
    script = DRIVER.format(tests=os.path.dirname(__file__), path=str(tmp_path))
    env = fast_jvm_env(dict(os.environ, PYTHONPATH=REPO, PYSPARK_PYTHON=sys.executable))
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        zygotes = [int(p) for p in proc.stdout.readline().split()]
        assert len(zygotes) == 2, "the driver script did not get to its warm job"
        deadline = time.monotonic() + 120
        while len(list(tmp_path.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        ranks = [int((tmp_path / str(r)).read_text()) for r in (0, 1)]
        keepers = [psutil.Process(r).ppid() for r in ranks]
        assert {psutil.Process(k).ppid() for k in keepers} == set(zygotes)
        proc.kill()
        proc.wait(timeout=10)
        assert alive_after(zygotes + keepers + ranks, timeout=60) == [], \
            "left behind by a killed driver"
    finally:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass


def zygote_names() -> set:
    """The abstract names zygotes listen on, as any process of the user reads them."""
    with open("/proc/net/unix") as f:
        return {line.split()[-1][1:] for line in f
                if line.split()[-1].startswith("@horovod-spark-zygote-")}


def every_zygote() -> list:
    """Every zygote process of this user: the one listening on a name, and those a worker
    started while the name was taken (no other process can reach them)."""
    return [proc for proc in psutil.process_iter(["cmdline"])
            if "collectives.launch.zygote" in " ".join(proc.info["cmdline"] or [])]


@pytest.mark.parametrize("mode,text", [("answer", "failed the proof"),
                                       ("silent", "gave no proof in 5 s")])
def test_a_process_that_took_the_zygotes_name_gets_nothing_and_the_job_starts_fresh(
        spark, tmp_path, capfd, mode, text):
    """The attack: kill the executor's zygote, bind its name, answer as the zygote did (or
    not at all). The job's ranks start fresh within seconds; the impostor gets no secret,
    no function and no channel, and the driver says who held the name."""
    from _zygote_impostor import __file__ as impostor_py

    key = new_key()
    before = zygote_names()
    horovod_spark.run(probe, num_proc=2, env=key)  # leaves the executor a zygote of this key
    names, stable_since, deadline = set(), time.monotonic(), time.monotonic() + 30
    while time.monotonic() < deadline and not (names and time.monotonic() - stable_since > 2):
        now = zygote_names() - before  # every task's zygote has bound its name, or given up
        names, stable_since = (now, time.monotonic()) if now != names else (names, stable_since)
        time.sleep(0.05)
    assert names, "the first job left no zygote listening"
    # the attacker kills them all (a task's zygote may still be starting: until none is seen)
    quiet_since, deadline = time.monotonic(), time.monotonic() + 20
    while time.monotonic() - quiet_since < 1.5 and time.monotonic() < deadline:
        zygotes = every_zygote()
        for zygote in zygotes:
            zygote.kill()
        assert alive_after([z.pid for z in zygotes]) == []
        quiet_since = time.monotonic() if zygotes else quiet_since
        time.sleep(0.1)
    impostors = []
    try:
        for i, name in enumerate(sorted(names)):
            impostors.append(subprocess.Popen(
                [sys.executable, impostor_py, name, mode, str(tmp_path / f"record{i}")],
                stdout=subprocess.PIPE, text=True))
            assert impostors[-1].stdout.readline() == "bound\n"
        capfd.readouterr()
        t0 = time.monotonic()
        ranks = horovod_spark.run(probe, num_proc=2, env=key)
        took = time.monotonic() - t0
        assert [r["forked"] for r in ranks] == [False, False]
        assert [r["total"] for r in ranks] == [3.0, 3.0]  # the ranks' own result, not a forgery
        assert took < 60, f"the fresh start took {took:.0f} s"
        received = [json.loads(line) for i in range(len(names))
                    if (tmp_path / f"record{i}").exists()
                    for line in (tmp_path / f"record{i}").read_text().splitlines()]
        assert received, "no task asked the impostor"
        assert all(len(bytes.fromhex(p["data"])) == 36 and p["fds"] == 0 and not p["channel"]
                   for p in received), received  # hellos only: no descriptor, no job byte
        out = capfd.readouterr()
        said = out.out + out.err
        assert text in said and "the rank starts fresh" in said
        assert any(f"process {imp.pid}" in said for imp in impostors)
    finally:
        for imp in impostors:
            imp.kill()
            imp.wait(timeout=10)
