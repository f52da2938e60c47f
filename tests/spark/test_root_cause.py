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


def test_a_lost_peer_that_tensorflow_reraised_as_its_own_error_still_blames_the_dead_rank():
    # TensorFlow turns an error inside a graph op into UnknownError, keeping our line
    wrapped = Failure(0, "UnknownError", "Graph execution error:\n\nDetected at node "
                      "HvsLaneAllreduce\n\nPeerLostError: allreduce 'g' on rank 0/2: local peer "
                      "process 7 has exited (peer rank 1 at 127.0.0.1:4000)", size=2)
    assert wrapped.kind == "comm" and wrapped.named_peer() == 1
    assert root_cause([wrapped, Failure(1, "ProcessDied", "killed", size=2)]).rank == 1
    assert Failure(0, "UnknownError", "a PeerLostError: quoted mid-line").kind == "own"


LOST_EXECUTOR = """Could not recover from a failed barrier ResultStage. Most recent failure reason: \
Stage failed because barrier task ResultTask(0, 1) finished unsuccessfully.
ExecutorLostFailure (executor 1 exited caused by one of the running tasks) Reason: Command \
exited with code 137"""


def test_a_lost_executor_keeps_sparks_reason_and_names_the_executor():
    f = spark_failure(LOST_EXECUTOR, 4)
    assert f.rank == 1 and f.error_type == "ExecutorLost" and f.kind == "death"
    assert "exited with code 137" in f.message and "executor 1" in f.message


LOST_WORKER = """Could not recover from a failed barrier ResultStage. Most recent failure reason: \
Stage failed because barrier task ResultTask(0, 3) finished unsuccessfully.
ExecutorLostFailure (executor 2 exited unrelated to the running tasks) Reason: worker lost: \
10.213.7.13:34191 got disassociated"""


def test_a_lost_worker_is_named_as_the_workers_loss_not_as_an_executor_killed():
    f = spark_failure(LOST_WORKER, 4)
    assert f.rank == 3 and f.error_type == "ExecutorLost" and "worker lost" in f.message
    assert "lost the Worker" in f.hint and "SIGKILL" not in f.hint, f.hint


def test_a_partition_between_two_reporting_hosts_names_the_pair_not_one_rank():
    # both leaders still reach the driver and each names the other; their local ranks
    # report their own leader through shared memory first
    cause = root_cause([_lost(1, 0, "10.0.0.1:4000", SHM), _lost(3, 2, "10.0.0.2:4001", SHM),
                        _lost(2, 0, "10.0.0.1:4100", TCP), _lost(0, 2, "10.0.0.2:4200", TCP)])
    assert cause.rank is None and cause.kind == "comm", cause
    assert "rank 2 at 10.0.0.2:4200 and rank 0 at 10.0.0.1:4100 cannot reach each other" \
        in cause.message, cause.message
    assert "10.0.0.2:4200 and 10.0.0.1:4100" in cause.hint, cause.hint


def test_errors_that_name_no_pair_or_name_a_local_pair_are_no_partition():
    # a ring of blame (0 -> 2 -> 1 -> 0): no pair, the earliest error stands
    first = _lost(0, 2, "10.0.0.2:4200", TCP)
    ring = [first, _lost(2, 1, "10.0.0.3:4300", TCP), _lost(1, 0, "10.0.0.1:4100", TCP)]
    assert root_cause(ring) == first
    # two ranks of one host waiting on each other through shared memory: not a network
    local = [_lost(2, 3, "10.0.0.2:4001", SHM), _lost(3, 2, "10.0.0.2:4000", SHM)]
    assert root_cause(local) == local[0]
