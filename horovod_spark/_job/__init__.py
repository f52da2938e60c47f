"""The job machinery: launch, watch and fail a job on Spark or on this machine.

Its face is this module: callers outside `_job` import what they use from here (a rule in
tests/core/test_layers.py), never a submodule.  It loads with the package: what a rank
process needs of the package's own lines (`log_to_driver`, `forward_warnings`) lives in
`horovod_spark.progress`, so no rank depends on this face.

    launch(fn, args, kwargs, opts, elastic=None)   every rank's value, in rank order
    displayed(opts)                                 the progress bar's setup of a job's opts
    BarrierJob, JobOptions, value_of                one barrier stage, for a caller's own stage
    JobFailedError, NotEnoughSlotsError, ResetLimitError
"""
from __future__ import annotations

from . import checks
from .cluster import Cluster, is_connect, to_arrow
from .driver import BarrierJob, JobOptions, payload_of, run_on_driver, run_on_spark, value_of
from .elastic import ElasticOptions, NotEnoughSlotsError, ResetLimitError
from .failure import JobFailedError
from .logchannel import LineSink, LogClient, LogServer
from .mpirun import run_mpi
from .options import env_items, job_timeout, start_timeout
from .pickling import code_files, pickle_job
from .quiet import failure_logs_off
from .session import get_session
from .start import displayed, launch
from .task import run_task

__all__ = ["BarrierJob", "Cluster", "ElasticOptions", "JobFailedError", "JobOptions",
           "LineSink", "LogClient", "LogServer", "NotEnoughSlotsError", "ResetLimitError",
           "checks", "code_files", "displayed", "failure_logs_off", "get_session", "is_connect",
           "launch", "payload_of", "pickle_job", "run_mpi", "run_on_driver", "run_on_spark",
           "run_task", "to_arrow", "value_of", "env_items", "job_timeout", "start_timeout"]
