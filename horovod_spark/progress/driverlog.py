"""A rank's lines for the driver's eyes: `log_to_driver`, and loggers forwarded there.

Under a Spark task (HVS_LOG_CALLBACK) a line marked with CALLBACK_MARK reaches the
driver's output whatever `driver_log_verbosity` says (the task forwards it on the log
channel, `horovod_spark._job.logchannel`); elsewhere it is a plain print.  Rank-side only:
nothing here imports the job machinery.
"""
from __future__ import annotations

import logging
import os

from ..settings import LOG_CALLBACK
from .marks import CALLBACK_MARK

__all__ = ["log_to_driver", "forward_warnings"]

_marks: dict = {}


def _marking() -> bool:
    """HVS_LOG_CALLBACK (the task sets it for its rank), read once per process."""
    if _marks.get("pid") != os.getpid():  # a rank forked from a zygote reads its own
        _marks.update(pid=os.getpid(), on=LOG_CALLBACK.read())
    return _marks["on"]


def log_to_driver(message: str) -> None:
    """Show `message` in the driver's output, whatever `driver_log_verbosity` says.

    Call it in the training function (Databricks' `sparkdl.horovod.log_to_driver`).
    """
    if _marking():
        message = "\n".join(CALLBACK_MARK + part for part in str(message).split("\n"))
    print(message, flush=True)


class _DriverHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            log_to_driver(self.format(record))
        except Exception:  # a failing output stream never fails the job
            self.handleError(record)


def forward_warnings(logger: str = "collectives") -> None:
    """Send `logger`'s records (at HOROVOD_LOG_LEVEL: warnings, such as a stall report, by
    default) to the driver's output whatever `driver_log_verbosity` says, when this
    process is a rank of a Spark task."""
    if not _marking():
        return
    target = logging.getLogger(logger)
    if any(isinstance(h, _DriverHandler) for h in target.handlers):
        return
    handler = _DriverHandler()  # the logger's level (HOROVOD_LOG_LEVEL) chooses
    handler.setFormatter(logging.Formatter("%(message)s"))
    target.addHandler(handler)
    target.propagate = False  # once, not also on stderr
