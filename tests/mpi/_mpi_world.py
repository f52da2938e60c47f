"""Run under mpiexec: every MPI check of one world size in one launch (starting ranks is the cost).

    mpiexec -n 3 python tests/mpi/_mpi_world.py [--front-end] [--suite]

Backend checks (_mpi_checks), then with --front-end collectives.init() and the
Communicator on the MPI backend (_mpi_init_prog), then with --suite the
shared collective suite.  Each part prints its own OK line per rank, so a
test can tell which part failed; the exit status is 1 if any part failed.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _mpi_checks import run_backend_checks  # noqa: E402
from _mpi_init_prog import run_front_end_checks  # noqa: E402


def main() -> int:
    status = run_backend_checks()
    if "--front-end" in sys.argv[1:]:
        status |= run_front_end_checks("--suite" in sys.argv[1:])
    return status


if __name__ == "__main__":
    sys.exit(main())
