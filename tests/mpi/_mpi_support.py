"""Helpers for the MPI tests: find mpiexec, run a program under it with a timeout."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest

from collectives.backends.shm_names import mpi_segments, remove_orphaned_mpi_segments

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
HERE = os.path.dirname(os.path.abspath(__file__))


def mpi_skip_reason() -> str | None:
    """Why the MPI tests cannot run here, or None."""
    if shutil.which("mpiexec") is None:
        return "mpiexec is not on PATH (pip install mpich)"
    sys.path.insert(0, REPO)
    from collectives.backends.mpi import available
    ok, reason = available()
    return None if ok else reason


requires_mpi = pytest.mark.skipif(mpi_skip_reason() is not None,
                                  reason=str(mpi_skip_reason()))


def clean_env(extra: dict | None = None) -> dict:
    """The test's environment without an outer launcher's rank variables."""
    from collectives.backends.mpi import MPIEXEC_VARIABLES
    env = {k: v for k, v in os.environ.items()
           if k not in MPIEXEC_VARIABLES and not k.startswith(("HVS_", "PMI_", "PMIX_", "OMPI_"))}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


def mpiexec(n: int, argv: list, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python argv...` on n ranks; a hang fails the test after `timeout` seconds.

    mpiexec runs in its own process group, so a timeout kills the launcher,
    its proxies and every rank, and leaves nothing behind.
    """
    cmd = ["mpiexec", "-n", str(n), sys.executable, *argv]
    before = mpi_segments()
    proc = subprocess.Popen(cmd, cwd=REPO, env=clean_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout} s; last output:\n{out[-4000:]}")
    finally:
        remove_orphaned_mpi_segments(before)  # what ranks mpiexec killed left
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def python(code: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python -c code` (no MPI launcher) in a clean environment.

    On timeout the process gets SIGTERM first (run_mpi then takes its mpiexec
    down), then SIGKILL; the test fails.
    """
    cmd = [sys.executable, "-c", code]
    proc = subprocess.Popen(cmd, cwd=REPO, env=clean_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(f"python -c ... did not finish in {timeout} s; last output:\n{out[-3000:]}{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
