"""Progress of a job: records the ranks write, one bar per job on the driver.

`report(...)` on the ranks; the driver's `Display` renders the bar.
"""
from .display import Display
from .driverlog import forward_warnings, log_to_driver
from .marks import ENABLED, PROGRESS_MARK
from .rank import Tracked, add_engine_source, count_steps_of, keras_callback, report

__all__ = ["report", "keras_callback", "Display", "Tracked", "PROGRESS_MARK", "ENABLED",
           "add_engine_source", "count_steps_of", "log_to_driver", "forward_warnings"]
