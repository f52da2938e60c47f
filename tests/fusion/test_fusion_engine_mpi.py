"""The same fusion engine checks over the MPI backend (ranks started by mpiexec).

The engine talks only to the Communicator, so every backend runs it; this
runs the full check list of _fusion_checks.py on two MPI ranks.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

import _fusion_checks as checks

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))


def _mpi_missing():
    if shutil.which("mpiexec") is None:
        return "mpiexec is not on PATH (pip install mpich)"
    from collectives.backends.mpi import available
    ok, reason = available()
    return None if ok else reason


pytestmark = [pytest.mark.mpi, pytest.mark.skipif(_mpi_missing() is not None,
                                                  reason=str(_mpi_missing()))]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("fusion_mpi"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HVS_", "PMI_", "PMIX_"))}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    cmd = ["mpiexec", "-n", "2", sys.executable, os.path.join(HERE, "_fusion_mpi_prog.py"), workdir]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"mpiexec did not finish in 180 s; last output:\n{out[-4000:]}")
    files = sorted(glob.glob(os.path.join(workdir, "results.*.json")))
    assert proc.returncode == 0 and len(files) == 2, out[-4000:]
    per_rank = [json.load(open(f)) for f in files]
    return {name: [res[name] for res in per_rank] for name in per_rank[0]}


@pytest.mark.parametrize("check", [c.__name__ for c in checks.CHECKS]
                         + ["a_stall_past_the_shutdown_time_fails_the_op"])
def test_every_engine_check_passes_over_mpi(results, check):
    bad = [f"rank {r}:\n{text}" for r, text in enumerate(results[check]) if text != "ok"]
    assert not bad, "\n".join(bad)
