"""Ranks of one host that do not share /dev/shm (containers with host networking).

Rank 2 of a host 'a' of three ranks enters a mount namespace of its own with a
private /dev/shm before init(): it can never attach to its peers' segment.  The
ranks split the host into shared-memory groups by what each sees, join the
groups over TCP, keep Horovod's local_rank/local_size (per host), and finish
without waiting for a segment that cannot appear.  The transport counters and
the DEBUG topology line say which path carried what.
"""
import os
import shutil

import pytest

from collectives.launch import run_local

needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                reason="a private /dev/shm needs root (mount namespaces)")


def _private_shm() -> None:
    """Enter a new mount namespace and mount a fresh tmpfs on /dev/shm (root only)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    CLONE_NEWNS, MS_REC, MS_PRIVATE = 0x00020000, 0x4000, 1 << 18
    for ok in (libc.unshare(CLONE_NEWNS) == 0,
               libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) == 0,
               libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", 0, b"size=64m") == 0):
        if not ok:
            raise OSError(ctypes.get_errno(), "a private /dev/shm")


def _allreduce_with(private_rank):
    import numpy as np

    import collectives

    if int(os.environ["HVS_RANK"]) == private_rank:
        _private_shm()
    comm = collectives.init()
    sums = []
    for count in (1, 1000, 300_000):  # one step, staged, and over a TCP chunk
        x = np.arange(count, dtype=np.float64) * (comm.rank + 1)
        sums.append(bool(np.array_equal(comm.allreduce(x), np.arange(count) * 6.0)))
    topo = comm.backend.topology
    out = {"local": [comm.local_rank, comm.local_size, comm.cross_size],
           "group": list(topo.shm_ranks), "sums": sums,
           "metrics": comm.transport_metrics()}
    comm.close()
    return out


@needs_root
@pytest.mark.timeout(120)
def test_ranks_of_one_host_without_a_common_dev_shm_meet_over_tcp(capfd):
    per_rank = run_local(_allreduce_with, 3, args=(2,), hosts=["a", "a", "a"], timeout=45,
                         env={"HOROVOD_LOG_LEVEL": "DEBUG"})
    assert [r["sums"] for r in per_rank] == [[True] * 3] * 3
    assert [r["local"] for r in per_rank] == [[0, 3, 1], [1, 3, 1], [2, 3, 1]]
    assert [r["group"] for r in per_rank] == [[0, 1], [0, 1], [2]]
    m0, m1, m2 = (r["metrics"] for r in per_rank)
    assert m0["shm_ops"] == m1["shm_ops"] == 3 and m2["shm_ops"] == 0
    assert m0["tcp_bytes_sent"] > 0 and m2["tcp_bytes_received"] > 0
    assert m1["tcp_ops"] == 0 and m1["tcp_bytes_sent"] == 0  # not its group's leader
    err = capfd.readouterr().err
    assert "2 shared-memory groups [a: 0,1 | 2]" in err, err[-3000:]
