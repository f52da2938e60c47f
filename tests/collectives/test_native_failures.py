"""Failures of the native backend, with real rank processes: a killed peer, a
stalled peer, no shared memory left behind, bounded memory.

The survivors write the error they caught to a file: the launcher kills the
whole job soon after the first rank dies, so a returned value would be lost.
"""
import glob
import json

import pytest

from collectives.launch import RankFailed, run_local

TCP = {"HOROVOD_SPARK_FORCE_TCP": "1"}


def _kill_one_and_report(victim, outdir, nbytes, mid_op=False):
    import os
    import signal
    import threading

    import numpy as np

    import collectives

    comm = collectives.init()
    x = np.ones(nbytes // 4, np.float32)
    comm.allreduce(x)  # everybody is up and connected
    if comm.rank == victim:
        if not mid_op:
            os.kill(os.getpid(), signal.SIGKILL)
        # dies while it runs back-to-back allreduces: almost surely inside one
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
    try:
        for _ in range(10_000 if mid_op else 2):
            comm.allreduce(x, out=x)
        report = {"error": None}
    except collectives.CollectiveError as exc:
        report = {"error": type(exc).__name__, "message": str(exc)}
    with open(os.path.join(outdir, f"rank{comm.rank}.json"), "w") as f:
        json.dump(report, f)
    return report


def _reports(tmp_path, size, victim):
    out = {}
    for r in range(size):
        path = tmp_path / f"rank{r}.json"
        if r != victim and path.exists():
            out[r] = json.loads(path.read_text())
    return out


@pytest.mark.parametrize("path,env,nbytes,mid_op", [
    ("shm", {}, 4096, False), ("shm", {}, 8 << 20, False), ("shm", {}, 8 << 20, True),
    ("shm", {"HOROVOD_SPARK_SHM_CMA": "0"}, 8 << 20, True),
    ("tcp", TCP, 4096, False), ("tcp", TCP, 8 << 20, False)],
    ids=["shm-small", "shm-large", "shm-large-mid-op", "shm-staged-large-mid-op", "tcp-small",
         "tcp-large"])
def test_a_killed_peer_is_named_in_the_error_on_every_other_rank(tmp_path, path, env, nbytes,
                                                                 mid_op):
    """(shm-large takes cross-memory attach where the kernel allows it; staged disables it.)"""
    env = {**env, "HOROVOD_SPARK_TIMEOUT": "20"}
    with pytest.raises(RankFailed) as info:
        run_local(_kill_one_and_report, 3, args=(2, str(tmp_path), nbytes, mid_op), env=env,
                  timeout=60)
    assert info.value.rank == 2, info.value
    reports = _reports(tmp_path, 3, victim=2)
    assert sorted(reports) == [0, 1], f"survivors did not report in time: {reports}"
    # A lost peer, not a timeout: found out from its process or its socket, within the timeout.
    first = [rep for rep in reports.values() if "peer rank 2" in rep["message"]]
    assert first, reports
    for rep in first:
        assert rep["error"] == "PeerLostError", rep
        assert "allreduce" in rep["message"] and "rank 2" in rep["message"], rep
    if path == "tcp":
        assert any("127.0.0.1:" in rep["message"] for rep in first), reports


def _stall_and_report(sleeper, outdir):
    import os
    import time

    import numpy as np

    import collectives

    comm = collectives.init()
    comm.allreduce(np.ones(8, np.float32))
    report = {"error": None}
    if comm.rank == sleeper:
        time.sleep(4.0)  # never joins the second allreduce in time
    else:
        try:
            comm.allreduce(np.ones(1 << 16, np.float32))
        except collectives.CollectiveError as exc:
            report = {"error": type(exc).__name__, "message": str(exc)}
    with open(os.path.join(outdir, f"rank{comm.rank}.json"), "w") as f:
        json.dump(report, f)
    return report


@pytest.mark.parametrize("env", [{}, TCP], ids=["shm", "tcp"])
def test_a_stalled_peer_gives_a_timeout_naming_peer_and_timeout(tmp_path, env):
    env = {**env, "HOROVOD_SPARK_TIMEOUT": "1.5"}
    reports = run_local(_stall_and_report, 2, args=(1, str(tmp_path)), env=env, timeout=60)
    rep = reports[0]
    assert rep["error"] == "CollectiveTimeout", rep
    assert "peer rank 1" in rep["message"] and "after 1.5 s" in rep["message"], rep
    assert "on rank 0/2" in rep["message"], rep


def _die_after_init():
    import os
    import signal

    import collectives

    comm = collectives.init()
    comm.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def _segments():
    return set(glob.glob("/dev/shm/hvs-*"))


def test_no_shared_memory_is_left_behind_even_when_every_rank_is_killed():
    before = _segments()
    with pytest.raises(RankFailed):
        run_local(_die_after_init, 3, timeout=60)
    assert _segments() - before == set()


def _peak_memory(nbytes):
    import resource

    import numpy as np

    import collectives

    comm = collectives.init()
    comm.barrier()
    start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    x = np.full(nbytes // 4, comm.rank + 1, np.float32)
    comm.allreduce(x, out=x)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ok = bool(x[0] == sum(range(1, comm.size + 1)) and x[-1] == x[0])
    comm.close()
    return {"grew": peak - start, "ok": ok}


@pytest.mark.parametrize("env", [{}, TCP], ids=["shm", "tcp"])
def test_a_256_mib_allreduce_needs_the_input_and_a_bounded_staging_buffer(env):
    nbytes = 256 << 20
    results = run_local(_peak_memory, 2, args=(nbytes,), env=env, timeout=120)
    for r in results:
        assert r["ok"]
        # the input itself, plus the shared slots (2 x 4 MiB) and slack; never a second copy
        assert r["grew"] <= nbytes + (32 << 20), f"peak grew by {r['grew'] / 2**20:.0f} MiB"


def test_closing_the_native_backend_twice_is_fine_and_later_ops_say_it_is_closed():
    import numpy as np

    import collectives
    from collectives.types import DType, ReduceOp

    comm = collectives.init()
    backend = comm.backend
    assert backend.name == "native"
    comm.close()
    comm.close()
    with pytest.raises(collectives.PeerLostError, match="native backend is closed"):
        backend.allreduce(np.zeros(4, np.float32), np.zeros(4, np.float32), DType.FLOAT32, ReduceOp.SUM)


def _disagree(kind):
    import numpy as np

    import collectives

    comm = collectives.init()
    comm.barrier()
    try:
        if kind == "sizes":
            comm.allreduce(np.ones(100 + 100 * comm.rank, np.float32))
        else:  # rank 0 reduces, rank 1 broadcasts
            x = np.ones(64, np.float32)
            comm.allreduce(x) if comm.rank == 0 else comm.broadcast(x, root=0)
    except collectives.CollectiveError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}


@pytest.mark.parametrize("kind", ["sizes", "ops"])
def test_ranks_that_disagree_on_a_collective_get_a_mismatch_error_naming_both(kind):
    reports = run_local(_disagree, 2, args=(kind,), env={"HOROVOD_SPARK_TIMEOUT": "20"}, timeout=60)
    for r, rep in enumerate(reports):
        assert rep["error"] == "MismatchError", rep
        assert f"peer rank {1 - r}" in rep["message"], rep
    if kind == "sizes":
        assert "allreduce sum of 100 float32" in reports[0]["message"]
        assert "allreduce sum of 200 float32" in reports[0]["message"]
    else:  # rank 1 reads rank 0's tag first; rank 0 hears of it from rank 1
        assert "broadcast of 64 float32 from rank 0" in reports[1]["message"]
        assert "allreduce sum of 64 float32" in reports[1]["message"]
