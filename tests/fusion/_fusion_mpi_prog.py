"""Run the fusion engine's checks as one rank started by mpiexec (the MPI backend).

    mpiexec -n 2 python tests/fusion/_fusion_mpi_prog.py WORKDIR
Writes WORKDIR/results.<rank>.json: {check: "ok" or the failure text}.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _fusion_checks as checks  # noqa: E402

if __name__ == "__main__":
    workdir = sys.argv[1]
    results = checks.run_all({"stall_check_time": 1.0, "backend": "mpi"}, workdir)
    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    with open(os.path.join(workdir, f"results.{rank}.json"), "w") as f:
        json.dump(results, f)
