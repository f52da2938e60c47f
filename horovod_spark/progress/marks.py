"""What the rank side and the driver's display of progress agree on: the record's
marks, the switch that turns records on, and the rate window."""
from __future__ import annotations

__all__ = ["PROGRESS_MARK", "CALLBACK_MARK", "ENABLED", "WINDOW", "POSITION"]

#: Starts a record.  STX, not a character str.splitlines() breaks at (as it does at \x1e).
PROGRESS_MARK = "\x02hvs-progress\x02"
#: Starts a line a rank sends through the task's log channel as a callback line.
CALLBACK_MARK = "\x1ehvs-log\x1e"
#: What a job adds to its ranks' environment to turn records on.
ENABLED = (("HVS_PROGRESS", "1"),)
#: Seconds of records the rates are computed over.
WINDOW = 5.0
#: The keys of a record that say where a rank is.
POSITION = ("epoch", "epochs", "step", "steps")
