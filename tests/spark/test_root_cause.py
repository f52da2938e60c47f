"""The driver's account of a failure: root causes among failures as tasks report them."""
from collectives.launch.record import Failure, root_cause
from horovod_spark._job.failure import spark_failure

SHM = "no progress from a local peer through shared memory"
TCP = "no data for 20 s"


def _lost(rank, peer, where, message):
    return Failure(rank, "CollectiveTimeout", f"allreduce #9 on rank {rank}/4: {message} "
                                               f"(peer rank {peer} at {where})", size=4)


def test_a_partition_is_blamed_on_the_cut_off_host_not_on_a_healthy_local_rank():
    # rank 1's shared-memory timeout arrives first; its leader's TCP timeout names host b,
    # whose ranks cannot report (their link is down)
    cause = root_cause([_lost(1, 0, "10.0.0.1:4000", SHM), _lost(0, 2, "10.0.0.2:4100", TCP)])
    assert cause.rank == 2 and cause.reported_by == 0 and "10.0.0.2" in cause.message


def test_a_death_still_wins_over_the_peers_that_lost_it():
    died = Failure(3, "ProcessDied", "killed", size=4)
    assert root_cause([_lost(2, 3, "10.0.0.2:4101", SHM), died]).rank == 3


LOST_EXECUTOR = """Could not recover from a failed barrier ResultStage. Most recent failure reason: \
Stage failed because barrier task ResultTask(0, 1) finished unsuccessfully.
ExecutorLostFailure (executor 1 exited caused by one of the running tasks) Reason: Command \
exited with code 137"""


def test_a_lost_executor_keeps_sparks_reason_and_names_the_executor():
    f = spark_failure(LOST_EXECUTOR, 4)
    assert f.rank == 1 and f.error_type == "ExecutorLost" and f.kind == "death"
    assert "exited with code 137" in f.message and "executor 1" in f.message
