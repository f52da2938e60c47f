"""Names of the native backend's shared-memory segments, and their removal by a parent.

Local rank 0 creates its host's segment as `/dev/shm/hvs-<its pid>-<random>` and
unlinks it as soon as every local rank has attached (or failed to).  A creator
killed in between (SIGKILL, with the whole job) cannot unlink it; the process
that started it (the local launcher, the Spark task) removes whatever its dead
child's pid names (`remove_segments_of`), so a killed job leaves nothing.

MPI runtimes keep segments of their own there (MPICH's `mpich_shm_*`) and leave them
when mpiexec kills its ranks after one fails; whoever ran mpiexec removes those that
appeared during its job and that no process maps any more
(`remove_orphaned_mpi_segments`).
"""
from __future__ import annotations

import glob
import os
import secrets
from typing import Iterable, List, Set

__all__ = ["segment_name", "remove_segments_of", "mpi_segments", "remove_orphaned_mpi_segments"]

_SHM = "/dev/shm"
#: Shared-memory segments of MPI runtimes: MPICH's, Open MPI's vader and sm transports.
MPI_PREFIXES = ("mpich_shm_", "vader_segment.", "sm_segment.")


def segment_name(pid: int) -> str:
    """A fresh segment name for a segment that process `pid` creates."""
    return f"/hvs-{pid}-{secrets.token_hex(8)}"


def remove_segments_of(pid: int) -> List[str]:
    """Unlink the segments process `pid` created and left (call it once `pid` has exited);
    returns their names."""
    gone = []
    for path in glob.glob(os.path.join(_SHM, f"hvs-{int(pid)}-*")):
        try:
            os.unlink(path)
            gone.append(os.path.basename(path))
        except OSError:  # another cleaner was first, or it is not ours to remove
            pass
    return gone


def mpi_segments() -> Set[str]:
    """The names of the MPI runtimes' segments in /dev/shm now."""
    try:
        return {n for n in os.listdir(_SHM) if n.startswith(MPI_PREFIXES)}
    except OSError:
        return set()


def _mapped(names: Iterable[str]) -> Set[str]:
    """Which of `names` some live process still maps (its /proc/PID/maps names the file)."""
    wanted, found = {f"{_SHM}/{n}": n for n in names}, set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                text = f.read()
        except OSError:  # the process ended, or is not ours to read
            continue
        found.update(n for path, n in wanted.items() if path in text)
    return found


def remove_orphaned_mpi_segments(before: Iterable[str]) -> List[str]:
    """Unlink the MPI segments that appeared since `before` (`mpi_segments()` taken before
    mpiexec started) and that no process maps: what ranks killed by mpiexec left.  A
    segment another job still uses is mapped by its ranks, so it stays; returns the
    names removed."""
    new = mpi_segments() - set(before)
    gone = []
    for name in sorted(new - _mapped(new)) if new else ():
        try:
            os.unlink(os.path.join(_SHM, name))
            gone.append(name)
        except OSError:
            pass
    return gone
