"""A stalled rank (alive, but it never calls the next op): reported, then failed, by the others.

With the fusion engine (horovod_spark.torch), the others' stall check names the
rank that has not submitted a tensor every HOROVOD_STALL_CHECK_TIME_SECONDS,
and HOROVOD_STALL_SHUTDOWN_TIME_SECONDS fails the op.  With plain Communicator
ops there is no name to agree on: the others fail at the op timeout
(HOROVOD_SPARK_TIMEOUT), naming the peer they wait for.
"""
from __future__ import annotations

import os
import sys

import pytest

import _fault_kit as kit
import _fault_ranks as ranks

CHECK, SHUTDOWN, OP_TIMEOUT = 1.0, 3.0, 3.0


def assert_nothing_left(out, fault) -> None:
    seconds, left = kit.wait_gone(fault.tag, timeout=10.0)
    assert not left, f"rank processes left {seconds:.1f} s after the job: {left}"
    assert kit.shm_segments(out.pids()) == []


@pytest.mark.slow
def test_a_stalled_rank_is_reported_by_the_others_then_fails_them_at_the_stall_timeout(fault):
    env = fault.env(timeout=30, HOROVOD_STALL_CHECK_TIME_SECONDS=CHECK,
                    HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=SHUTDOWN)
    out = kit.run_local_job(ranks.stall_in_fused, 3, args=(fault.outdir, 2, 2), env=env,
                            outdir=fault.outdir)
    assert out.error is not None, out.value
    assert "not yet by ranks [2]" in str(out.error), str(out.error)
    stalled_at = kit.note_of(out, "stalled", 2)["t"]
    errors, warnings = out.notes("error"), out.notes("warnings")
    for r in (0, 1):
        assert errors[r]["type"] == "CollectiveTimeout", errors[r]
        assert "not yet by ranks [2]" in errors[r]["message"], errors[r]
        assert "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS" in errors[r]["message"], errors[r]
        reports = [w for w in warnings[r]["lines"] if "not yet by ranks [2]" in w]
        assert reports and "stalled for" in reports[0], warnings[r]
        after = errors[r]["t"] - stalled_at
        assert SHUTDOWN <= after < 30, f"rank {r} failed {after:.1f} s into the stall"
    assert_nothing_left(out, fault)


@pytest.mark.slow
@pytest.mark.parametrize("freeze", [False, True], ids=["sleeping", "sigstopped"])
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_rank_stalled_in_a_plain_allreduce_fails_the_others_at_the_timeout_naming_it(
        fault, transport, freeze):
    """SIGSTOP is the peer whose kernel still accepts our bytes but which never answers.

    Every survivor must fail by itself, so no launcher tears them down: a launcher stops the
    others a second after the first failure (by design), and under load that could come
    before a survivor has written its own error."""
    from collectives.launch import start_ranks

    code = ("import _fault_ranks as r; "
            f"r.stall_in_allreduce({fault.outdir!r}, 1, 3, {freeze})")
    with open(os.devnull, "w") as sink:
        group, _ = start_ranks([sys.executable, "-c", code], 3,
                               fault.env(tcp=transport == "tcp", timeout=OP_TIMEOUT),
                               stdout=sink, stderr=sink)
        with group:  # its exit stops the stalled rank
            kit.wait_until(lambda: all(group.procs[r].poll() is not None for r in (0, 2)),
                           OP_TIMEOUT + 30.0, "both survivors exit")
    out = kit.Outcome(None, None, 0.0, 0.0, fault.outdir, "")
    stalled_at = kit.note_of(out, "stalled", 1)["t"]
    errors = out.notes("error")
    for r in (0, 2):  # the first to time out leaves; the other may see it leave first
        assert r in errors, f"rank {r} left no error: {errors}"
        assert errors[r]["type"] in ("CollectiveTimeout", "PeerLostError"), errors[r]
        after = errors[r]["t"] - stalled_at
        assert OP_TIMEOUT <= after < OP_TIMEOUT + 10, f"rank {r} failed {after:.1f} s into it"
    assert any(e["type"] == "CollectiveTimeout" and "peer rank 1 " in e["message"]
               and f"after {OP_TIMEOUT:g} s" in e["message"] for e in errors.values()), errors
    assert_nothing_left(out, fault)


ROOT_CAUSE = ("the driver names a survivor's error about another survivor: RankGroup._root_cause "
              "takes the lowest failed rank among communication errors, and on the TCP ring rank "
              "0 waits for rank 2, which waits for the stalled rank 1 (collectives/launch/procs.py; "
              "fix: among communication errors follow 'peer rank N' to a rank that reported no "
              "communication error itself, and report the error that names it)")


@pytest.mark.slow
def test_the_driver_names_the_rank_stalled_in_a_plain_allreduce(fault):
    out = kit.run_local_job(ranks.stall_in_allreduce, 3, args=(fault.outdir, 1, 3),
                            env=fault.env(tcp=True, timeout=OP_TIMEOUT), outdir=fault.outdir)
    assert out.error is not None and "peer rank 1 " in str(out.error).splitlines()[0], \
        str(out.error).splitlines()[0]
