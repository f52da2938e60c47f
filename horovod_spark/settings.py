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

__all__ = ["DriverSettings", "table", "check_job_env", "driver_only", "HOROVOD", "horovod_rows",
           "warn_horovod", "RENDEZVOUS", "CLIENT_ADDRESS", "WARM_START", "START_TIMEOUT",
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
        warn_horovod({**env, **job_env})
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


# -- Horovod's variables ----------------------------------------------------------------
# Every HOROVOD_* variable of Horovod 0.28's documentation a launch script may set.  Those
# this package honours with Horovod's meaning are rows of the table above (collectives'
# SETTINGS: the fusion threshold, cycle time, timeline and its cycle marks, the response
# cache, stall checks, log level and time stamps, CPU operations, dynamic process sets,
# autotune) or
# of the launchers' contract (HOROVOD_RANK ...).  The rest are here: what each did in
# Horovod, what happens to it here, what to do instead.  The driver warns once per name,
# and per value where only some values are honoured (`warn_horovod`).

@dataclasses.dataclass(frozen=True)
class HorovodKnob:
    """A Horovod variable this package does not honour as Horovod did (see above).

    `honoured`: the values that mean here what they meant there (no warning for them)."""

    name: str
    horovod: str
    here: str
    honoured: Tuple[str, ...] = ()


def _knob(name: str, horovod: str, here: str, honoured: Tuple[str, ...] = ()) -> HorovodKnob:
    return HorovodKnob(name, horovod, here, honoured)


HOROVOD: Tuple[HorovodKnob, ...] = (
    _knob("HOROVOD_HIERARCHICAL_ALLREDUCE", "allreduce within each host, then across the "
          "hosts' leaders, then broadcast within", "always so here: shared memory within a "
          "host, the host leaders over TCP; 0 cannot make it flat", ("1",)),
    _knob("HOROVOD_HIERARCHICAL_ALLGATHER", "allgather within each host, then across hosts",
          "always so here (as HOROVOD_HIERARCHICAL_ALLREDUCE); 0 cannot make it flat", ("1",)),
    _knob("HOROVOD_GPU_OPERATIONS", "the GPU backend (nccl or mpi; at build and at run time)",
          "CUDA tensors are reduced with NCCL (HOROVOD_SPARK_BACKEND=nccl); mpi is not "
          "built here", ("nccl",)),
    _knob("HOROVOD_GPU_ALLREDUCE", "the GPU allreduce's backend", "NCCL, as "
          "HOROVOD_GPU_OPERATIONS", ("nccl",)),
    _knob("HOROVOD_GPU_ALLGATHER", "the GPU allgather's backend", "NCCL, as "
          "HOROVOD_GPU_OPERATIONS", ("nccl",)),
    _knob("HOROVOD_GPU_BROADCAST", "the GPU broadcast's backend", "NCCL, as "
          "HOROVOD_GPU_OPERATIONS", ("nccl",)),
    _knob("HOROVOD_GPU_ALLTOALL", "the GPU alltoall's backend", "NCCL, as "
          "HOROVOD_GPU_OPERATIONS", ("nccl",)),
    _knob("HOROVOD_CONTROLLER", "what coordinates the ranks (mpi or gloo)", "the ranks "
          "coordinate over this package's mesh, bootstrapped from the Spark task addresses; "
          "for MPI's collectives set HOROVOD_SPARK_BACKEND=mpi"),
    _knob("HOROVOD_MPI_THREADS_DISABLE", "initialise MPI without thread support",
          "the MPI backend (mpi4py) initialises MPI as mpi4py does; nothing to disable"),
    _knob("HOROVOD_NUM_NCCL_STREAMS", "CUDA streams for NCCL operations", "one engine "
          "stream a rank"),
    _knob("HOROVOD_BATCH_D2D_MEMCOPIES", "batch the fusion buffer's device copies in one "
          "kernel", "the fused copies are torch's, one a tensor"),
    _knob("HOROVOD_DISABLE_NVTX_RANGES", "no NVTX ranges in Nsight profiles", "no NVTX "
          "ranges are emitted", ("1",)),
    _knob("HOROVOD_ENABLE_ASYNC_COMPLETION", "finish GPU ops without blocking the "
          "background thread", "not built here: GPU ops complete in the engine's cycle"),
    _knob("HOROVOD_ENABLE_XLA_OPS", "Horovod's ops inside XLA-compiled TensorFlow functions",
          "not built here: a tf.function with jit_compile=True fails naming the op"),
    _knob("HOROVOD_DISABLE_GROUP_FUSION", "grouped allreduces are not fused with other "
          "tensors", "a group's members fuse like any ready tensors"),
    _knob("HOROVOD_THREAD_AFFINITY", "CPU cores the background threads are pinned to",
          "the engine's threads are not pinned (taskset the executor instead)"),
    _knob("HOROVOD_ADASUM_MPI_CHUNK_SIZE", "chunk size of Adasum's MPI exchanges",
          "Adasum runs over the native mesh, unchunked"),
    _knob("HOROVOD_CCL_CACHE", "oneCCL's cache of operations", "oneCCL is not built here"),
    _knob("HOROVOD_CCL_BGT_AFFINITY", "oneCCL's worker thread core", "oneCCL is not built "
          "here"),
    _knob("HOROVOD_GLOO_IFACE", "the network interface Gloo binds", "each rank binds its "
          "Spark task's address (spark.driver.host / the executor's host)"),
    _knob("HOROVOD_GLOO_TIMEOUT_SECONDS", "Gloo's rendezvous and op timeout",
          "set HOROVOD_SPARK_CONNECT_TIMEOUT (start-up) and HOROVOD_SPARK_TIMEOUT (ops)"),
    _knob("HOROVOD_GLOO_RENDEZVOUS_ADDR", "horovodrun's rendezvous server (set by it)",
          "the ranks meet at the job's store (HOROVOD_SPARK_RENDEZVOUS)"),
    _knob("HOROVOD_GLOO_RENDEZVOUS_PORT", "horovodrun's rendezvous port (set by it)",
          "the ranks meet at the job's store (HOROVOD_SPARK_RENDEZVOUS)"),
    _knob("HOROVOD_HOSTNAME", "this host's name for horovodrun's placement (set by it)",
          "placement comes from the Spark task addresses"),
    _knob("HOROVOD_ELASTIC_TIMEOUT", "seconds elastic Horovod waits for hosts",
          "a job restarts whole (run(max_restarts=...)); HOROVOD_SPARK_START_TIMEOUT bounds "
          "the wait for task slots"),
)


def horovod_rows() -> Tuple[Tuple[str, str, str], ...]:
    """(name, Horovod's meaning, what it does here) for every Horovod variable (the docs'
    table): those honoured first, from the settings tables, then `HOROVOD`."""
    honoured = tuple((s.name, s.doc, "honoured") for s in table()
                     if s.name.startswith("HOROVOD_") and not s.name.startswith("HOROVOD_SPARK_"))
    return honoured + tuple((k.name, k.horovod, k.here) for k in HOROVOD)


#: Horovod's names the launchers set on every rank (a value on the driver is replaced there).
SET_FOR_RANKS = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
                 "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE")

#: Horovod's build switches (pip install horovod): nothing is built that way here.
_BUILD_PREFIXES = tuple("HOROVOD_" + p for p in (  # (spelled so: they are no variables here)
    "WITH_", "WITHOUT_", "BUILD_", "CUDA_", "NCCL_", "ROCM_", "MPI", "CMAKE", "DEBUG", "GPU"))


def warn_horovod(env: Mapping[str, str]) -> None:
    """Warn once per name (and value) about a Horovod variable this package does not honour
    as Horovod did, naming what to do instead; and about Horovod's values this package
    maps (HOROVOD_CACHE_CAPACITY=0, HOROVOD_CPU_OPERATIONS=gloo/ccl)."""
    knobs = {k.name: k for k in HOROVOD}
    known = {s.name for s in table()} | set(knobs) | set(SET_FOR_RANKS)
    for name in sorted(env):
        value = str(env[name]).strip()
        if not name.startswith("HOROVOD_") or name.startswith("HOROVOD_SPARK_") or value == "":
            continue
        said = None
        if name in knobs:
            knob = knobs[name]
            if value.lower() not in knob.honoured:
                said = f"Horovod's {name} ({knob.horovod}) is not honoured here: {knob.here}"
        elif name == "HOROVOD_CACHE_CAPACITY" and value == "0":
            said = ("HOROVOD_CACHE_CAPACITY=0 (Horovod's response cache off): this engine's "
                    "ranks agree through the cache, so it keeps 1 signature; set 1 to say so")
        elif name == "HOROVOD_CPU_OPERATIONS" and value.lower() in ("gloo", "ccl"):
            said = (f"HOROVOD_CPU_OPERATIONS={value}: this package's native transport (shared "
                    f"memory and TCP) takes {value}'s place; set mpi for MPI's collectives")
        elif name not in known:
            near = difflib.get_close_matches(name, sorted(known), n=1)
            if name.startswith(_BUILD_PREFIXES) and not difflib.get_close_matches(
                    name, sorted(known), n=1, cutoff=0.9):  # (not a typo of a known name)
                said = (f"{name} is one of Horovod's build switches (pip install horovod); "
                        f"nothing is built that way here")
            else:
                hint = f"did you mean {near[0]}?" if near else "see docs/configuration.md"
                said = f"environment variable {name} is not one of Horovod's nor this package's; {hint}"
        if said is not None and (name, value) not in _warned:
            _warned.add((name, value))
            warnings.warn(said, stacklevel=4)  # the caller of run() / fit()


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
