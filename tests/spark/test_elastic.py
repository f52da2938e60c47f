"""run_elastic on a real local[2] session (and local ranks): resume from the last commit.
Resuming on local ranks is tests/tf/test_elastic_keras.py's; an executor lost,
tests/spark/test_runner_local_cluster.py's."""
from __future__ import annotations

import pickle

import pytest
import torch

from _spark_support import by_value, new_tag, start_session, stop_session, \
    wait_until_no_rank_processes

import _elastic_training as training
import horovod_spark
from horovod_spark import JobFailedError, NotEnoughSlotsError, ResetLimitError

by_value(__name__)
by_value("_elastic_training")
pytestmark = [pytest.mark.spark, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def spark():
    session = start_session("local[2]")
    yield session
    stop_session(session)


def test_a_rank_sigkilled_mid_training_resumes_to_the_uninterrupted_runs_weights(spark, tmp_path):
    marker = str(tmp_path / "killed")
    whole = horovod_spark.run_elastic(training.train, args=(10, 3), num_proc=2)
    tag = new_tag()
    resumed = horovod_spark.run_elastic(training.train, args=(10, 3, 7, marker), num_proc=2,
                                        reset_limit=1, env={"HVS_TEST_TAG": tag})
    assert [r[:2] for r in whole] == [(0, 2), (0, 2)]
    assert [r[:2] for r in resumed] == [(6, 2), (6, 2)]  # from the commit at step 6, not 9
    assert [r[4] for r in whole] == [[], []] and [r[4] for r in resumed] == [[2], [2]]
    for (_, _, weights, momentum, _), (_, _, w, m, _) in zip(whole, resumed):
        assert all(torch.equal(a, b) for a, b in zip(weights, w))
        assert all(torch.equal(a, b) for a, b in zip(momentum, m))
    for a, b in zip(whole[0][2], training.reference(10)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    assert wait_until_no_rank_processes(tag) == []


def _processed(outdir) -> dict:
    """{(attempt, epoch): [indices]} over every rank's log."""
    import glob
    import os

    out: dict = {}
    for path in glob.glob(os.path.join(outdir, "rank*-attempt*")):
        attempt = int(path.rsplit("attempt", 1)[1])
        with open(path) as f:
            for line in f:
                epoch, index = map(int, line.split())
                out.setdefault((attempt, epoch), []).append(index)
    return out


def test_an_elastic_sampler_resumes_an_epoch_with_only_its_unprocessed_samples(spark, tmp_path):
    """Horovod's ElasticSampler: 24 samples, 2 ranks, batches of 2, a commit after each batch;
    rank 1 dies after 3 batches of epoch 1; the next attempt processes the rest of epoch 1
    (each sample once in all) and epoch 2 whole."""
    marker = str(tmp_path / "killed")
    starts = horovod_spark.run_elastic(training.sample_epochs,
                                       args=(24, 3, 2, str(tmp_path), 3, marker), num_proc=2,
                                       reset_limit=1)
    assert starts == [(2, 1, 12), (2, 1, 12)]  # epoch 1, 3 batches x 2 x 2 ranks processed
    seen = _processed(str(tmp_path))
    assert sorted(seen[0, 0]) == list(range(24))                 # epoch 0, before the kill
    assert len(seen[0, 1]) == 12 and len(set(seen[0, 1])) == 12  # 3 batches of epoch 1
    assert sorted(seen[0, 1] + seen[1, 1]) == list(range(24))    # the rest, once, after it
    assert sorted(seen[1, 2]) == list(range(24))                 # epoch 2 whole


def _dies_on_rank_1():
    import os
    import signal

    import numpy as np

    import collectives

    comm = collectives.init()
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    comm.allreduce(np.ones(4))


def test_the_reset_limit_reached_is_a_named_error_listing_each_attempts_failed_rank(spark):
    with pytest.raises(ResetLimitError) as info:
        horovod_spark.run_elastic(_dies_on_rank_1, num_proc=2, reset_limit=1)
    err = info.value
    assert [(a.number, a.size, a.failure.rank, a.failure.error_type) for a in err.history] == \
        [(1, 2, 1, "ProcessDied"), (2, 2, 1, "ProcessDied")]
    text = str(err)
    assert "reset_limit=1 reached after 2 failed attempts" in text
    assert "attempt 1 (2 ranks): rank 1 on host" in text and "SIGKILL" in text
    assert isinstance(err, JobFailedError) and err.rank == 1
    again = pickle.loads(pickle.dumps(err))  # a run() in a worker pool hands it back whole
    assert str(again) == text and again.history == err.history


def test_fewer_slots_than_min_num_proc_is_a_named_error_before_any_stage(spark):
    with pytest.raises(NotEnoughSlotsError, match=r"2 free barrier task slots.*fewer than "
                                                  r"min_num_proc=3") as info:
        horovod_spark.run_elastic(lambda: 0, num_proc=3, min_num_proc=3)
    assert str(pickle.loads(pickle.dumps(info.value))) == str(info.value)


def _counts(steps, marker):
    import os
    import signal

    import horovod_spark.torch as hvd

    hvd.init()
    state = hvd.elastic.ObjectState(count=0, commits=[])
    resets = []
    state.register_reset_callbacks([lambda: resets.append(True)])

    @hvd.elastic.run
    def loop(state):
        first = state.count
        while state.count < steps:
            state.count += 1
            hvd.allreduce(torch.ones(1), name="step")  # the ranks go in step
            if state.count % 2 == 0:
                state.commits.append(state.count)
                state.commit()
            if state.count == 5 and hvd.rank() == 0 and not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
        return first, state.count, state.commits, resets

    return loop(state)


def test_an_object_state_counter_resumes_from_its_last_commit_after_rank_0_died(spark, tmp_path):
    out = horovod_spark.run_elastic(_counts, args=(8, str(tmp_path / "killed")), num_proc=2,
                                    reset_limit=2)
    assert out == [(4, 8, [2, 4, 6, 8], [True])] * 2


def test_an_error_of_the_function_itself_is_not_retried(tmp_path):
    def fails(marker):
        with open(marker, "a") as f:
            f.write("x")
        raise ValueError("the function's own bug")

    marker = tmp_path / "runs"
    with pytest.raises(JobFailedError, match="ValueError: the function's own bug") as info:
        horovod_spark.run_elastic(fails, args=(str(marker),), num_proc=-2, reset_limit=3)
    assert not isinstance(info.value, ResetLimitError)
    assert marker.read_text() == "xx"  # one attempt of two ranks


@pytest.mark.parametrize("kwargs, says", [
    (dict(num_proc=2, min_num_proc=3, max_num_proc=2), "min_num_proc=3 is more than max_num_proc=2"),
    (dict(num_proc=2, min_num_proc=0), "min_num_proc must be an int >= 1, got 0"),
    (dict(num_proc=2, reset_limit=-1), "reset_limit must be an int >= 0 or None, got -1"),
])
def test_sizes_and_limits_run_elastic_cannot_use_are_refused_before_anything_starts(kwargs, says):
    with pytest.raises(ValueError, match=says):
        horovod_spark.run_elastic(lambda: 0, **kwargs)
