"""Names of the native backend's shared-memory segments, and their removal by a parent.

Local rank 0 creates its host's segment as `/dev/shm/hvs-<its pid>-<random>` and
unlinks it as soon as every local rank has attached (or failed to).  A creator
killed in between (SIGKILL, with the whole job) cannot unlink it; the process
that started it (the local launcher, the Spark task) removes whatever its dead
child's pid names (`remove_segments_of`), so a killed job leaves nothing.
"""
from __future__ import annotations

import glob
import os
import secrets
from typing import List

__all__ = ["segment_name", "remove_segments_of"]

_SHM = "/dev/shm"


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
