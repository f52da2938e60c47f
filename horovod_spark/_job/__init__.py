"""The job machinery: launch, watch and fail a job on Spark or on this machine.

Its face is this module: callers outside `_job` import what they use from here (a rule in
tests/core/test_layers.py), never a submodule.  The names load on first use, so a rank
process that needs one (`forward_warnings`) does not import the driver's side.

    launch(fn, args, kwargs, opts, elastic=None)   every rank's value, in rank order
    displayed(opts)                                 the progress bar's setup of a job's opts
    BarrierJob, JobOptions, value_of                one barrier stage, for a caller's own stage
    JobFailedError, NotEnoughSlotsError, ResetLimitError
"""
from __future__ import annotations

import importlib
from typing import Any

#: name -> the submodule that defines it
_FACE = {
    "launch": "start", "displayed": "start",
    "BarrierJob": "driver", "JobOptions": "driver", "value_of": "driver",
    "run_on_driver": "driver", "run_on_spark": "driver", "payload_of": "driver",
    "JobFailedError": "failure",
    "ElasticOptions": "elastic", "NotEnoughSlotsError": "elastic", "ResetLimitError": "elastic",
    "get_session": "session",
    "Cluster": "cluster", "is_connect": "cluster", "to_arrow": "cluster",
    "log_to_driver": "logchannel", "forward_warnings": "logchannel",
    "LogServer": "logchannel", "LogClient": "logchannel", "LineSink": "logchannel",
    "pickle_job": "pickling", "code_files": "pickling",
    "run_task": "task", "run_mpi": "mpirun", "failure_logs_off": "quiet",
    "checks": None,  # the module itself: checks before submitting
}
__all__ = sorted(_FACE)


def __getattr__(name: str) -> Any:
    if name not in _FACE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _FACE[name] is None:
        return importlib.import_module(f"{__name__}.{name}")
    value = getattr(importlib.import_module(f"{__name__}.{_FACE[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_FACE))
