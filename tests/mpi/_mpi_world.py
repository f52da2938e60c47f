"""Run under mpiexec: every MPI check of one world size in one launch (starting ranks is the cost).

    mpiexec -n 3 python tests/mpi/_mpi_world.py [--front-end] [--suite]

Backend checks (_mpi_checks), then with --front-end collectives.init() and the
Communicator on the MPI backend (_mpi_init_prog), then with --suite the
shared collective suite, and NCCL's bootstrap exchange over MPI (no GPU needed).  Each part prints its own OK line per rank, so a
test can tell which part failed; the exit status is 1 if any part failed.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _mpi_checks import run_backend_checks  # noqa: E402
from _mpi_init_prog import run_front_end_checks  # noqa: E402


def run_nccl_bootstrap_over_mpi() -> int:
    """Without a store (the MPI backend's case) NCCL's bootstrap records travel over MPI."""
    from mpi4py import MPI

    from collectives.backends._nccl_boot import bootstrap
    from collectives.backends.base import Topology
    from collectives.errors import CollectiveError

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    topo = Topology(rank, size, ("host",) * size)
    try:
        uid = bootstrap(None, topo, "job/comm0", f"gpu-{rank}", lambda: os.urandom(128), 30.0)
        uids = world.allgather(uid.hex())  # the test's own check, not the code under test
        assert len(set(uids)) == 1 and len(uid) == 128, uids
        try:
            bootstrap(None, topo, "job/comm1", "gpu-0", lambda: os.urandom(128), 30.0)
        except CollectiveError as exc:
            assert f"ranks {', '.join(map(str, range(size)))} on host host share GPU gpu-0" in str(exc)
        else:
            raise AssertionError("ranks sharing a GPU were not refused")
    except Exception:  # noqa: BLE001 - report, then fail the launch
        import traceback

        print("FAIL nccl bootstrap", traceback.format_exc(), flush=True)
        return 1
    print(f"MPI NCCL BOOT OK rank {rank}/{size}", flush=True)
    return 0


def main() -> int:
    status = run_backend_checks()
    if "--front-end" in sys.argv[1:]:
        status |= run_front_end_checks("--suite" in sys.argv[1:])
        status |= run_nccl_bootstrap_over_mpi()
    return status


if __name__ == "__main__":
    sys.exit(main())
