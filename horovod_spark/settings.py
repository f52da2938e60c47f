"""horovod_spark's environment variables, in the table collectives.settings starts.

Each switch is read once, at its edge: the driver's in `DriverSettings.read()`
when a job starts (run, HorovodRunner.run, fit), the task's when the task starts,
the rank's when the rank first needs it in its process.  `table()` lists every row
of both packages, for the docs and the test that holds them to it.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import warnings
from typing import Mapping, Optional, Tuple

from collectives.settings import CONTRACT as _COLLECTIVES_CONTRACT
from collectives.settings import SETTINGS as _COLLECTIVES
from collectives.settings import FINISH_GRACE, Setting, parse_bool

__all__ = ["DriverSettings", "table", "check_job_env", "driver_only", "RENDEZVOUS", "CLIENT_ADDRESS", "WARM_START", "START_TIMEOUT",
           "PARQUET_DIRECT", "TF_LANE", "TORCH_LANE", "CACHE", "PROGRESS", "LOG_CALLBACK", "DYNAMIC_PROCESS_SETS",
           "DEEPSPEED_CONFIG"]


def _rendezvous(text: str) -> str:
    value = text.strip().lower()
    if value not in ("driver", "spark"):
        raise ValueError("expected driver or spark")
    return value


RENDEZVOUS = Setting("HOROVOD_SPARK_RENDEZVOUS", "driver", _rendezvous, "driver",
                     "where a job's ranks meet: the driver's store, or rank 0's through allGather")
CLIENT_ADDRESS = Setting("HOROVOD_SPARK_CLIENT_ADDRESS", None, str, "driver",
                         "on Spark Connect: the address the executors reach this process at "
                         "(live output, the job store); none: they cannot")
WARM_START = Setting("HOROVOD_SPARK_WARM_START", True, parse_bool, "driver",
                     "fork ranks from the executor's zygote (the task reads it too)")
START_TIMEOUT = Setting("HOROVOD_SPARK_START_TIMEOUT", 600.0, float, "driver",
                        "seconds to wait for np barrier task slots")
PARQUET_DIRECT = Setting("HOROVOD_SPARK_PARQUET_DIRECT", True, parse_bool, "driver",
                         "the estimator's ranks read a Parquet DataFrame's files themselves")
TF_LANE = Setting("HOROVOD_SPARK_TF_LANE", True, parse_bool, "rank",
                  "TensorFlow's traced allreduces run as the native lane op")
TORCH_LANE = Setting("HOROVOD_SPARK_TORCH_LANE", True, parse_bool, "rank",
                     "torch's named allreduces of CPU tensors (blocking, and in-place async) "
                     "run in the native lane")
CACHE = Setting("HOROVOD_SPARK_CACHE", None, str, "rank",
                "where the TensorFlow lane op is compiled to")
DYNAMIC_PROCESS_SETS = Setting("HOROVOD_DYNAMIC_PROCESS_SETS", False, parse_bool, "rank",
                               "hvd.add_process_set / remove_process_set after init()")
PROGRESS = Setting("HVS_PROGRESS", False, parse_bool, "rank",
                   "the rank writes progress records (the driver shows a bar)", contract=True)
DEEPSPEED_CONFIG = Setting("HOROVOD_SPARK_DEEPSPEED_CONFIG", None, str, "rank",
                           "DeepspeedTorchDistributor: the path of the job's DeepSpeed config "
                           "in a function's rank", contract=True)
LOG_CALLBACK = Setting("HVS_LOG_CALLBACK", False, parse_bool, "rank",
                       "log_to_driver marks its lines (the Spark task filters on it)", contract=True)

_OWN = (RENDEZVOUS, CLIENT_ADDRESS, WARM_START, START_TIMEOUT, PARQUET_DIRECT, TF_LANE, TORCH_LANE, CACHE,
        PROGRESS,
        LOG_CALLBACK, DYNAMIC_PROCESS_SETS, DEEPSPEED_CONFIG)
_PREFIXES = ("HOROVOD_SPARK_", "HVS_")
_warned: set = set()


def table() -> Tuple[Setting, ...]:
    """Every variable either package reads: collectives' switches and contract, then ours."""
    return _COLLECTIVES + _COLLECTIVES_CONTRACT + _OWN


@dataclasses.dataclass(frozen=True)
class DriverSettings:
    """The driver's switches for one job, read when it starts."""

    rendezvous: str = RENDEZVOUS.default
    client_address: Optional[str] = CLIENT_ADDRESS.default
    warm_start: bool = WARM_START.default
    start_timeout: float = START_TIMEOUT.default
    parquet_direct: bool = PARQUET_DIRECT.default
    finish_grace: float = FINISH_GRACE.default

    @classmethod
    def read(cls, job_env: Mapping[str, str] = (), environ: Optional[Mapping[str, str]] = None
             ) -> "DriverSettings":
        """From the driver's environment; the job's `env` wins for HOROVOD_SPARK_WARM_START and
        HOROVOD_SPARK_FINISH_GRACE_SECONDS.

        Raises:
            ValueError: a value that does not parse, naming the variable.
        """
        env = os.environ if environ is None else environ
        job_env = dict(job_env)
        warn_unknown({**env, **job_env})
        check_job_env(job_env)
        warm = WARM_START.read(job_env) if job_env.get(WARM_START.name) else WARM_START.read(env)
        grace = FINISH_GRACE.read(job_env if job_env.get(FINISH_GRACE.name) else env)
        return cls(rendezvous=RENDEZVOUS.read(env), client_address=CLIENT_ADDRESS.read(env),
                   warm_start=warm, start_timeout=START_TIMEOUT.read(env),
                   parquet_direct=PARQUET_DIRECT.read(env), finish_grace=grace)


def check_job_env(job_env: Mapping[str, str]) -> None:
    """Every variable of the table in a job's `env`, parsed on the driver before any rank
    starts: a value the rank or the task would refuse (or, for a switch read only where it
    is used, ignore) fails the job here, naming the variable."""
    for setting in table():
        if not setting.contract and job_env.get(setting.name, "") != "":
            setting.read(job_env)


def driver_only(job_env: Mapping[str, str], environ: Optional[Mapping[str, str]] = None
                ) -> Tuple[Tuple[str, str], ...]:
    """The rank- and task-side variables set in the driver's environment and not in the
    job's `env`: a Spark rank sees them only where its executor's environment has them too
    (its task says so when it does not, see `_job.task`)."""
    env = os.environ if environ is None else environ
    return tuple((s.name, env[s.name]) for s in table()
                 if s.where != "driver" and not s.contract and env.get(s.name, "") != ""
                 and s.name not in job_env)


def warn_unknown(env: Mapping[str, str]) -> None:
    """Warn once per name about a HOROVOD_SPARK_* / HVS_* variable no table lists (a typo)."""
    known = {s.name for s in table()} | {"HVS_BUILD_JOBS"}  # setup.py's
    for name in sorted(env):
        if name.startswith(_PREFIXES) and name not in known and name not in _warned:
            _warned.add(name)
            near = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f"did you mean {near[0]}?" if near else "see the README's configuration table"
            warnings.warn(f"environment variable {name} is not one horovod_spark reads; {hint}",
                          stacklevel=4)  # the caller of run() / fit()
