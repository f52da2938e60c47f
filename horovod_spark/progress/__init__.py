"""Progress of a job: records the ranks write, one bar per job on the driver.

`report(...)` on the ranks; the driver's `Display` renders the bar.
"""
from .display import Display
from .rank import ENABLED, PROGRESS_MARK, FitTracked, Tracked, keras_callback, report

__all__ = ["report", "keras_callback", "Display", "Tracked", "FitTracked", "PROGRESS_MARK",
           "ENABLED"]
