"""HOROVOD_LOG_LEVEL applied: the level of a package's loggers on a rank, and where they write.

The rank sets the level of its package loggers (`collectives`, and the adapters'
`horovod_spark`) when it joins a job.  Where the process has configured no
logging of its own (the root logger has no handler, as in a rank a launcher
started), records go to stderr with the rank in front, so they reach the
driver with the rank's other output; where it has, or the logger has a handler
of its own (a Spark rank's channel to the driver), those show them.
The native library never logs: it returns a status, which becomes the exception.
"""
from __future__ import annotations

import logging
import sys
from typing import Iterable

__all__ = ["apply_log_level"]

_FORMAT = "[%(asctime)s hvs rank {rank}/{size}] %(levelname)s %(name)s: %(message)s"
_FORMAT_NO_TIME = "[hvs rank {rank}/{size}] %(levelname)s %(name)s: %(message)s"  # LOG_HIDE_TIME


class _RankHandler(logging.StreamHandler):
    """The handler this module adds (one per logger, replaced when a rank joins again)."""


def apply_log_level(level: str, rank: int, size: int,
                    names: Iterable[str] = ("collectives",), hide_time: bool = False) -> None:
    """Set `level` (a level name) on the loggers `names`; stderr shows them if nothing else does."""
    configured = bool(logging.getLogger().handlers)
    for name in names:
        logger = logging.getLogger(name)
        logger.setLevel(level)
        for old in [h for h in logger.handlers if isinstance(h, _RankHandler)]:
            logger.removeHandler(old)
        if not configured and not logger.handlers:  # else those show them (the driver's channel)
            handler = _RankHandler(sys.stderr)
            form = _FORMAT_NO_TIME if hide_time else _FORMAT
            handler.setFormatter(logging.Formatter(form.format(rank=rank, size=size)))
            logger.addHandler(handler)
