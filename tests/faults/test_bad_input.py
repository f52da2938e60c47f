"""Bad input through the public API: each a clear error, raised before any work where it can be.

"Before any work" is checked, not assumed: no rank process starts (the test
process has no new children), no Spark job is submitted, and in a running
world a refused op costs no communication (the next good op still pairs up
across ranks and gives the right answer).
"""
from __future__ import annotations

import threading

import numpy as np
import psutil
import pytest

import _fault_kit as kit
import _fault_work as work
import horovod_spark
from collectives import ReduceOp
from collectives.launch import run_local
from horovod_spark import HorovodRunner

torch = pytest.importorskip("torch")


def _no_new_children(before: set) -> bool:
    return {p.pid for p in psutil.Process().children(recursive=True)} <= before


def _children() -> set:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def train(**kwargs):
    return 1


# --------------------------------------------------------------------------- launchers

LAUNCH_ERRORS = [
    ("run_local, np=0", lambda: run_local(train, 0),
     ValueError, "np must be a positive"),
    ("run_local, a non-callable", lambda: run_local(42, 2),
     TypeError, "needs a callable, got int"),
    ("run_local, a lock in kwargs", lambda: run_local(
        train, 2, kwargs={"lock": threading.Lock()}), TypeError, "cannot pickle '_thread.lock'"),
    ("HorovodRunner, np=0", lambda: HorovodRunner(np=0),
     ValueError, "np=0 runs no rank"),
    ("HorovodRunner, np=2.0", lambda: HorovodRunner(np=2.0),
     TypeError, "np must be an int"),
    ("HorovodRunner, a non-callable", lambda: HorovodRunner(np=-2).run(42),
     TypeError, "must be callable, got int"),
    ("HorovodRunner, a lock in kwargs", lambda: HorovodRunner(np=-2).run(
        train, lock=threading.Lock()), TypeError, "keyword argument 'lock' is a _thread.lock"),
    ("run, num_proc=0", lambda: horovod_spark.run(train, num_proc=0),
     ValueError, "np=0 runs no rank"),
    ("run, a non-callable", lambda: horovod_spark.run("train", num_proc=-2),
     TypeError, "must be callable, got str"),
    ("run, a lock in args", lambda: horovod_spark.run(
        train, args=(threading.Lock(),), num_proc=-2), TypeError, "argument 0 is a _thread.lock"),
    ("run, max_restarts=-1", lambda: horovod_spark.run(train, num_proc=-2,
                                                                       max_restarts=-1),
     ValueError, "max_restarts must be an int >= 0"),
    ("run, env a list", lambda: horovod_spark.run(train, num_proc=-2, env=[("a", "b")]),
     TypeError, "env must be a mapping"),
    ("run, args a string", lambda: horovod_spark.run(train, args="abc", num_proc=-2),
     TypeError, "args must be a tuple or list of positional arguments for fn, got str 'abc'"),
    ("run, args an int", lambda: horovod_spark.run(train, args=5, num_proc=-2),
     TypeError, "args must be a tuple or list .* got int 5; for one argument write args=(x,)"),
    ("run_local, args a string", lambda: run_local(train, 2, args="abc"),
     TypeError, "args must be a tuple or list"),
    ("run, an env value of None", lambda: horovod_spark.run(train, num_proc=-2, env={"X": None}),
     TypeError, "env['X'] is NoneType None: values must be strings"),
    ("run, an env name with =", lambda: horovod_spark.run(train, num_proc=-2, env={"A=B": "1"}),
     ValueError, "'A=B' is not an environment variable name"),
    ("run, an env name with NUL", lambda: horovod_spark.run(train, num_proc=-2, env={"A\0": "1"}),
     ValueError, "is not an environment variable name"),
    ("run, an env value with NUL", lambda: horovod_spark.run(train, num_proc=-2, env={"A": "x\0"}),
     ValueError, "env['A'] holds a NUL character"),
]


@pytest.mark.parametrize("what,call,error,text", LAUNCH_ERRORS, ids=[c[0] for c in LAUNCH_ERRORS])
def test_a_launcher_refuses_bad_input_before_any_rank_starts(what, call, error, text):
    before = _children()
    with pytest.raises(error, match=text.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        call()
    assert _no_new_children(before), f"{what}: a process was started"


def test_the_cli_refuses_a_missing_script_in_one_line(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "horovod_spark.cli", "run", "--np", "2",
                           "missing.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done
    assert done.stderr.strip().splitlines() == [
        f"horovod-spark run: no such script: missing.py (from {tmp_path})"], done.stderr


@pytest.mark.spark
@pytest.mark.slow
def test_an_estimator_whose_store_cannot_be_written_is_refused_before_training(spark, tmp_path):
    from horovod_spark.estimator import LocalStore, TorchEstimator

    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the store's directory would go")
    net = torch.nn.Linear(2, 1)
    est = TorchEstimator(num_proc=2, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                         loss=torch.nn.MSELoss(), feature_cols=["x"], label_cols=["y"],
                         store=LocalStore(str(blocked / "store")), epochs=1, verbose=0)
    df = spark.createDataFrame([([1.0, 2.0], 3.0)] * 8, ["x", "y"])
    ranks = []

    def watch_for_ranks():  # a rank process is the worker module, whoever its parent is
        while not done.is_set():
            for p in psutil.Process().children(recursive=True):
                try:
                    if "collectives.launch.worker" in " ".join(p.cmdline()):
                        ranks.append(p.pid)
                except psutil.Error:
                    pass
            done.wait(0.05)

    done = threading.Event()
    watcher = threading.Thread(target=watch_for_ranks, daemon=True)
    watcher.start()
    try:
        with pytest.raises(ValueError, match=r"the store LocalStore\(.*\) cannot be written"):
            est.fit(df)
    finally:
        done.set()
        watcher.join()
    assert not ranks, "a rank process was started"


KWARGS_LIST = ("run(kwargs=[1]) fails inside dict() with \"cannot convert dictionary update "
               "sequence element #0 to a sequence\", which does not say that kwargs must be a "
               "mapping (horovod_spark/runner.py run: check isinstance(kwargs, Mapping) like env)")


def test_kwargs_that_are_not_a_mapping_are_named_in_the_error():
    with pytest.raises(TypeError, match="kwargs"):
        horovod_spark.run(train, kwargs=[1], num_proc=-2)


@pytest.mark.spark
def test_on_spark_kwargs_that_do_not_pickle_are_refused_before_any_spark_job(spark):
    tracker = spark.sparkContext.statusTracker()
    jobs = set(tracker.getJobIdsForGroup(None))
    before = _children()
    with pytest.raises(TypeError, match="keyword argument 'lock' is a _thread.lock"):
        horovod_spark.run(train, kwargs={"lock": threading.Lock()}, num_proc=2)
    assert set(tracker.getJobIdsForGroup(None)) == jobs, "a Spark job was submitted"
    assert _no_new_children(before)


# --------------------------------------------------------------------------- tensors, one rank

@pytest.fixture(scope="module")
def comm():
    import collectives

    c = collectives.init()
    yield c
    c.close()


TENSOR_ERRORS = [
    ("complex numpy", lambda c: c.allreduce(np.ones(3, np.complex64)), TypeError,
     "unsupported dtype complex64"),
    ("object numpy", lambda c: c.allreduce(np.array([1, "a"], object)), TypeError,
     "unsupported dtype object"),
    ("uint16 numpy", lambda c: c.allreduce(np.ones(3, np.uint16)), TypeError,
     "unsupported dtype uint16"),
    ("complex torch", lambda c: c.allreduce(torch.ones(3, dtype=torch.complex64)), TypeError,
     "unsupported dtype complex64"),
    ("a string", lambda c: c.allreduce("abc"), TypeError, "unsupported dtype"),
    ("AVERAGE of ints", lambda c: c.allreduce(np.ones(3, np.int32), op=ReduceOp.AVERAGE),
     TypeError, "AVERAGE needs a floating dtype"),
    ("an unknown op", lambda c: c.allreduce(np.ones(3, np.float32), op=99), ValueError,
     "not a valid ReduceOp"),
    ("a root outside the world", lambda c: c.broadcast(np.ones(3, np.float32), root=5), ValueError,
     r"root must be a rank in \[0, 1\)"),
    ("an out of another dtype", lambda c: c.allreduce(np.ones(3, np.float32), out=np.ones(3)),
     ValueError, "output float64"),
    ("a non-contiguous numpy out", lambda c: c.allreduce(
        np.ones(4, np.float32), out=np.ones((4, 2), np.float32)[:, 0]), ValueError,
     "not C-contiguous"),
    ("a non-contiguous torch broadcast", lambda c: c.broadcast(torch.ones(4, 4).t()), ValueError,
     r"not contiguous .* call .contiguous\(\)"),
    ("a read-only broadcast", lambda c: c.broadcast(np.frombuffer(b"\0" * 16, np.float32)),
     ValueError, "read-only"),
    ("alltoall splits that do not sum", lambda c: c.alltoall(np.ones(4, np.float32), splits=[3]),
     ValueError, "must be 1 non-negative numbers that sum to the first dimension 4"),
]


@pytest.mark.parametrize("what,call,error,text", TENSOR_ERRORS, ids=[c[0] for c in TENSOR_ERRORS])
def test_a_bad_tensor_is_refused_at_the_call(comm, what, call, error, text):
    with pytest.raises(error, match=text):
        call(comm)


@pytest.mark.parametrize("make", [
    lambda: np.arange(32, dtype=np.float32).reshape(4, 8)[:, ::2],
    lambda: torch.arange(32, dtype=torch.float32).reshape(4, 8).t(),
], ids=["numpy", "torch"])
def test_a_non_contiguous_input_is_reduced_correctly_when_nothing_writes_into_it(comm, make):
    x = make()
    out = comm.allreduce(x)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x))
    assert type(out) is type(x) and tuple(out.shape) == tuple(x.shape)


def test_hvd_refuses_bad_tensors_in_the_callers_thread():
    import horovod_spark.torch as hvd

    hvd.init()
    try:
        with pytest.raises(TypeError, match="unsupported dtype complex64"):
            hvd.allreduce_async(torch.ones(3, dtype=torch.complex64), name="c")
        h = hvd.allreduce_async(torch.ones(3), name="dup")
        with pytest.raises(ValueError, match="'.*dup' .*already pending"):
            hvd.allreduce_async(torch.ones(3), name="dup")
        assert torch.equal(hvd.synchronize(h), torch.ones(3))
        with pytest.raises(TypeError, match="handle"):
            hvd.synchronize(torch.ones(3))
    finally:
        hvd.shutdown()


# --------------------------------------------------------------------------- across ranks

def test_a_refused_op_costs_no_communication_the_next_op_still_pairs_up():
    results = run_local(work.refused_then_paired, 3, timeout=60)
    assert results[0][0] and "complex64" in results[0][0]
    assert [r[1] for r in results] == [[6.0] * 5] * 3


@pytest.mark.parametrize("kind", ["shape", "dtype"])
def test_a_named_tensor_whose_shape_or_dtype_differs_across_ranks_is_named_on_every_rank(kind):
    messages = run_local(work.fused_mismatch, 2, args=(kind,), timeout=60)
    for m in messages:
        assert "grad.w" in m and "rank" in m, messages
    want = ("10", "12") if kind == "shape" else ("float32", "float64")
    assert all(w in messages[0] for w in want), messages


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_plain_allreduce_whose_count_differs_across_ranks_fails_on_every_rank(fault, transport):
    out = kit.run_local_job(work.plain_mismatch, 2,
                            env=fault.env(tcp=transport == "tcp"), outdir=fault.outdir)
    assert out.error is None, out.error
    assert all("disagree" in m and "10" in m and "12" in m for m in out.value), out.value
