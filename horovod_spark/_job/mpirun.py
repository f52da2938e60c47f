"""`horovod-spark run --mpi`: start the ranks with mpiexec instead of Spark.

The ranks get their rank, size and placement from MPI (collectives.init()
sees the launcher's PMI variables and builds the MPI backend), so the
environment handed down carries no HVS_* rank variables, which would send
init() to the native backend's store, and sets HOROVOD_SPARK_BACKEND=mpi, so
the choice holds even under a launcher whose variables we do not recognise.
mpiexec runs in its own process group: Ctrl-C or a SIGTERM to us reaches it,
and the function returns only after mpiexec and its ranks are gone, and after the
shared-memory segments the MPI runtime's killed ranks left are removed.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from typing import Mapping, Optional, Sequence

from collectives.backends.shm_names import mpi_segments, remove_orphaned_mpi_segments

__all__ = ["run_mpi", "mpiexec_command"]

# Variables of another launch that must not leak into the ranks.
_RANK_PREFIXES = ("HVS_", "PMI_", "PMIX_", "OMPI_COMM_WORLD_", "MPI_LOCAL")
_RANK_NAMES = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
               "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE")


def mpiexec_command(np: int, script: str, args: Sequence[str] = (),
                    mpiexec: Optional[str] = None, mpiexec_args: Sequence[str] = ()) -> list:
    """The command line: `mpiexec -n np [mpiexec_args] python script args...`.

    A `.py` script runs under this Python; anything else runs as a program.

    Raises:
        ValueError: np < 1.
        FileNotFoundError: no mpiexec on PATH (with the install hint).
    """
    if int(np) < 1:
        raise ValueError(f"horovod-spark run --mpi: --np must be >= 1, got {np}")
    exe = mpiexec or shutil.which("mpiexec") or shutil.which("mpirun")
    if exe is None:
        raise FileNotFoundError("horovod-spark run --mpi: mpiexec is not on PATH; "
                                "pip install mpi4py mpich (or load your site's MPI module)")
    prog = [sys.executable, script] if script.endswith(".py") else [script]
    return [exe, "-n", str(int(np)), *mpiexec_args, *prog, *args]


def _rank_environment(env: Optional[Mapping[str, str]]) -> dict:
    from collectives.launch.torchrun import VARIABLES

    base = dict(os.environ if env is None else env)
    out = {k: v for k, v in base.items()
           if not k.startswith(_RANK_PREFIXES) and k not in _RANK_NAMES and k not in VARIABLES}
    out["HOROVOD_SPARK_BACKEND"] = "mpi"
    return out


def run_mpi(np: int, script: str, args: Sequence[str] = (), env: Optional[Mapping[str, str]] = None,
            *, mpiexec: Optional[str] = None, mpiexec_args: Sequence[str] = (),
            timeout: Optional[float] = None) -> int:
    """Run `script` on `np` local ranks under mpiexec; returns its exit status.

    Args:
        env: the environment for the ranks (default: this process's), less
            any rank variables of an enclosing launch.
        timeout: seconds before mpiexec and every rank are killed (status 124).
    """
    cmd = mpiexec_command(np, script, args, mpiexec, mpiexec_args)
    before = mpi_segments()
    proc = subprocess.Popen(cmd, env=_rank_environment(env), start_new_session=True)
    previous = _on_sigterm_exit()
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc, signal.SIGKILL)
        return 124
    except KeyboardInterrupt:
        # mpiexec forwards SIGINT to the ranks; give them a moment, then make sure.
        _kill_group(proc, signal.SIGINT)
        try:
            return proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _kill_group(proc, signal.SIGKILL)
            return 130
    finally:
        if proc.poll() is None:
            _kill_group(proc, signal.SIGKILL)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        remove_orphaned_mpi_segments(before)


def _on_sigterm_exit():
    """Turn SIGTERM into SystemExit so `finally` takes mpiexec down with us (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, stop)


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    if sig == signal.SIGKILL:
        proc.wait()
