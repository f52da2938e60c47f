"""Every environment variable collectives reads, in one table, and the configuration of a run
built from it (`Config`).

A *switch* is a variable a user may set; each is read once, at its *edge*: the
process that reads it ("driver": the one that calls `run` or `fit`; "task": the
Spark task and its zygote; "rank": `collectives.init()`) reads it when it starts
and passes the typed value down.  A *contract* variable is one a launcher sets
for the rank process (RankEnv reads those as one record).  horovod_spark's own
rows use the same `Setting` (horovod_spark/settings.py); the README and
docs/architecture.md list these tables, and a test holds them to it.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping, Optional

__all__ = ["Setting", "parse_bool", "parse_log_level", "choice", "number", "SETTINGS", "CONTRACT",
           "WHERE",
           "ZYGOTE_IDLE_S", "WARM_REPORT", "FINISH_GRACE", "RETURN_RANKS", "Config"]

#: The processes a setting is read in.
WHERE = ("driver", "task", "rank")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_LEVELS = {"TRACE": "DEBUG", "DEBUG": "DEBUG", "INFO": "INFO", "WARNING": "WARNING",
           "WARN": "WARNING", "ERROR": "ERROR", "FATAL": "CRITICAL", "CRITICAL": "CRITICAL"}


def parse_bool(text: str) -> bool:
    """The one spelling of a yes/no switch: 1/true/yes/on or 0/false/no/off, any case."""
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"expected one of {'/'.join(_TRUE)} or {'/'.join(_FALSE)}")


def parse_log_level(text: str) -> str:
    """A Python logging level name; Horovod's TRACE and FATAL map to DEBUG and CRITICAL."""
    level = _LEVELS.get(text.strip().upper())
    if level is None:
        raise ValueError(f"expected one of {', '.join(_LEVELS)}")
    return level


@dataclasses.dataclass(frozen=True)
class Setting:
    """One environment variable: its typed default, its parser, where it is read, its doc."""

    name: str
    default: Any
    parse: Callable[[str], Any]
    where: str
    doc: str
    field: Optional[str] = None  # the collectives.Config field it fills, if any
    contract: bool = False       # set by a launcher for the rank, not by a user

    def __post_init__(self) -> None:
        if self.where not in WHERE:
            raise ValueError(f"Setting {self.name}: where must be one of {WHERE}, got {self.where!r}")

    def read(self, env: Optional[Mapping[str, str]] = None) -> Any:
        """The typed value in `env` (default: this process's), or the default when unset or empty.

        Raises:
            ValueError: naming the variable, its value and what it accepts.
        """
        text = (os.environ if env is None else env).get(self.name, "")
        if text == "":
            return self.default
        try:
            return self.parse(text)
        except ValueError as exc:
            raise ValueError(f"environment variable {self.name}={text!r} is not valid: {exc}") from None

    @property
    def default_text(self) -> str:
        """The default as the docs write it."""
        if self.default is None:
            return "unset"
        if isinstance(self.default, bool):
            return "1" if self.default else "0"
        if isinstance(self.default, float) and self.default.is_integer():
            return str(int(self.default))
        return str(self.default)


def parse_grace(text: str) -> float:
    """Seconds >= 0, where 0 means no limit."""
    value = float(text)
    if not value >= 0:
        raise ValueError("expected seconds >= 0 (0 waits for ever)")
    return value


def choice(*values: str) -> Callable[[str], str]:
    """A parser of one of `values`, any case."""
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in values:
            raise ValueError(f"expected {', '.join(values[:-1])} or {values[-1]}")
        return value
    return parse


def number(kind: Callable[[str], Any], low: float, above: bool = False,
           unit: str = "") -> Callable[[str], Any]:
    """A parser of a `kind` (int or float) of `unit`s, at least `low` (above it, with `above`)."""
    what = ("a whole number" if kind is int else "a number") + (f" of {unit}" if unit else "")
    bound = f"{'above' if above else 'at least'} {low:g}"

    def parse(text: str) -> Any:
        try:
            value = kind(text.strip())
        except ValueError:
            raise ValueError(f"expected {what}, {bound}") from None
        if not (value > low if above else value >= low):
            raise ValueError(f"expected {what}, {bound}")
        return value
    return parse


def parse_cache_capacity(text: str) -> int:
    """HOROVOD_CACHE_CAPACITY: a whole number of signatures; Horovod's 0 (no cache) is 1 here
    (the driver says so when a job starts)."""
    return max(number(int, 0, unit="signatures")(text), 1)


def _config(name: str, field: str, default: Any, parse: Callable[[str], Any], doc: str) -> Setting:
    return Setting(name, default, parse, "rank", doc, field=field)


ZYGOTE_IDLE_S = Setting("HOROVOD_SPARK_ZYGOTE_IDLE_S", 600.0,
                        number(float, 0, above=True, unit="seconds"), "task",
                        "seconds a zygote waits for the next job before it exits")
FINISH_GRACE = Setting("HOROVOD_SPARK_FINISH_GRACE_SECONDS", 60.0, parse_grace, "driver",
                       "once a rank returned, seconds the others may run on; 0: for ever")
RETURN_RANKS = Setting("HVS_RETURN_RANKS", None, str, "rank", "the ranks whose value is pickled "
                       "back, comma-separated (unset: every rank)", contract=True)
WARM_REPORT = Setting("HVS_WARM_REPORT", None, str, "rank", "modules whose import the worker "
                      "reports to the task (warm starts)", contract=True)

#: The user's switches of collectives: the rank reads those with a field in Config.create.
SETTINGS = (
    _config("HOROVOD_FUSION_THRESHOLD", "fusion_threshold", 64 * 1024 * 1024,
            number(int, 0, unit="bytes"),
            "largest fusion buffer, in bytes"),
    _config("HOROVOD_CYCLE_TIME", "cycle_time_ms", 1.0, number(float, 0, unit="milliseconds"),
            "milliseconds between the fusion engine's cycles"),
    _config("HOROVOD_TIMELINE", "timeline", None, str, "path of a Chrome-trace timeline (rank 0)"),
    _config("HOROVOD_TIMELINE_MARK_CYCLES", "timeline_mark_cycles", False, parse_bool,
            "the timeline marks the start of every fusion cycle"),
    _config("HOROVOD_CACHE_CAPACITY", "cache_capacity", 1024, parse_cache_capacity,
            "signatures the response cache keeps (0, Horovod's off, is 1 here)"),
    _config("HOROVOD_AUTOTUNE", "autotune", False, parse_bool,
            "tune the fusion threshold and the cycle time online (rank 0 searches, every "
            "rank applies)"),
    _config("HOROVOD_AUTOTUNE_LOG", "autotune_log", None, str,
            "CSV file rank 0 writes autotune's samples to"),
    _config("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", "autotune_warmup_samples", 3,
            number(int, 0, unit="samples"), "autotune's first samples, discarded"),
    _config("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "autotune_steps_per_sample", 10,
            number(int, 1, unit="steps"), "steps (reductions of a tensor) a sample lasts"),
    _config("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "autotune_bayes_opt_max_samples", 20,
            number(int, 1, unit="samples"), "samples scored before the best is kept"),
    _config("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "autotune_gaussian_process_noise", 0.8,
            number(float, 0, unit="of the scores' spread"), "the search's noise"),
    _config("HOROVOD_STALL_CHECK_DISABLE", "stall_check_disable", False, parse_bool,
            "no stall reports (nor a stall's shutdown)"),
    _config("HOROVOD_STALL_CHECK_TIME_SECONDS", "stall_check_time", 60.0, number(float, 0),
            "seconds before a tensor some ranks never submit is reported"),
    _config("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "stall_shutdown_time", 120.0, number(float, 0),
            "seconds of stall before the ops that wait fail; 0: never"),
    _config("HOROVOD_LOG_LEVEL", "log_level", "WARNING", parse_log_level,
            "Python logging level of the collectives and horovod_spark loggers on the ranks"),
    _config("HOROVOD_LOG_HIDE_TIME", "log_hide_time", False, parse_bool,
            "the ranks' log records carry no time stamp"),
    _config("HOROVOD_CPU_OPERATIONS", "cpu_operations", None, choice("mpi", "gloo", "ccl"),
            "Horovod's CPU backend: mpi selects the MPI backend (where HOROVOD_SPARK_BACKEND "
            "is unset); gloo and ccl the native transport"),
    _config("HOROVOD_SPARK_TIMEOUT", "timeout", 30.0, number(float, 0, above=True, unit="seconds"),
            "seconds without progress from a peer before an op raises CollectiveTimeout"),
    _config("HOROVOD_SPARK_CONNECT_TIMEOUT", "connect_timeout", 60.0,
            number(float, 0, above=True, unit="seconds"),
            "seconds to reach the store and the peers at start-up"),
    _config("HOROVOD_SPARK_BACKEND", "backend", "auto", choice("auto", "native", "mpi", "nccl"),
            "auto, native, mpi or nccl"),
    _config("HOROVOD_SPARK_FORCE_TCP", "force_tcp", False, parse_bool,
            "every rank a host of its own, so one machine takes the TCP path"),
    _config("HOROVOD_SPARK_SHM_SLOT_BYTES", "shm_slot_bytes", 4 * 1024 * 1024,
            number(int, 4096, unit="bytes"),
            "bytes of shared-memory staging per local rank"),
    _config("HOROVOD_SPARK_SHM_CMA", "shm_cma", True, parse_bool,
            "large allreduces within a host read the peers' buffers in place"),
    _config("HOROVOD_SPARK_MESH_INTEGRITY", "mesh_integrity", "control",
            choice("control", "payload", "off"),
            "what the native TCP transport tags after the handshake (HMAC-SHA256): control "
            "(op headers, mismatch notices, the job's coordination), payload (and every op's "
            "data), off; the same on every rank"),
    ZYGOTE_IDLE_S,
    FINISH_GRACE,
)

#: What a launcher hands a rank (read as one record by RankEnv, listed here for the docs).
CONTRACT = tuple(Setting(name, None, parse, "rank", doc, contract=True) for name, parse, doc in (
    ("HVS_RANK", int, "world rank"), ("HVS_SIZE", int, "world size"),
    ("HVS_LOCAL_RANK", int, "rank on this host"), ("HVS_LOCAL_SIZE", int, "ranks on this host"),
    ("HVS_CROSS_RANK", int, "index of this host"), ("HVS_CROSS_SIZE", int, "hosts"),
    ("HVS_HOST", str, "host identity"), ("HVS_BIND_ADDR", str, "address to bind to"),
    ("HVS_STORE_ADDR", str, "host:port of the rendezvous store"),
    ("HVS_CHANNEL", str, "descriptor and inode of the rank's channel, which carries the secret"),
    ("HVS_SECRET", str, "hex of the per-job secret, where no channel is given (a launch by hand)"),
    ("HVS_JOB", str, "key prefix of the attempt"),
    ("HVS_GPU_ORDINAL", int, "CUDA ordinal of this rank's own GPU (optional)"),
    ("HVS_HOSTS", str, "every rank's host, in rank order (optional; the mesh's plan then "
                       "needs no host map)"),
)) + (WARM_REPORT, RETURN_RANKS)


#: What the native transport tags after the handshake (HOROVOD_SPARK_MESH_INTEGRITY):
#: "control" (op headers, mismatch notices and the job's coordination ops), "payload" (and
#: every op's payload), "off" (nothing).
MESH_INTEGRITY = ("control", "payload", "off")


# -- Config -----------------------------------------------------------------------------
# One typed, frozen configuration per run, built from arguments first, then the
# environment (Horovod's names where they exist; the rows of SETTINGS that name a field),
# read when a rank makes its communicator.  Unknown keys are rejected with the list of
# known ones, so a typo never silently falls back to a default.


@dataclasses.dataclass(frozen=True)
class Config:
    #: Seconds without progress from a peer before an op raises CollectiveTimeout.
    timeout: float = 30.0
    #: Seconds to connect to peers and the store during bootstrap.
    connect_timeout: float = 60.0
    #: Largest fused buffer in bytes (HOROVOD_FUSION_THRESHOLD).
    fusion_threshold: int = 64 * 1024 * 1024
    #: Milliseconds between fusion cycles (HOROVOD_CYCLE_TIME).
    cycle_time_ms: float = 1.0
    #: Path of a Chrome-trace timeline, or None (HOROVOD_TIMELINE).
    timeline: Optional[str] = None
    #: Seconds before a tensor some ranks never submit is reported (HOROVOD_STALL_CHECK_TIME_SECONDS).
    stall_check_time: float = 60.0
    #: Seconds before a stall fails the ops that wait (a named error on their ranks); 0: never
    #: (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS).
    stall_shutdown_time: float = 120.0
    #: Python logging level name (HOROVOD_LOG_LEVEL).
    log_level: str = "WARNING"
    #: Log records without their time (HOROVOD_LOG_HIDE_TIME).
    log_hide_time: bool = False
    #: Horovod's CPU operations, "mpi", "gloo" or "ccl" (HOROVOD_CPU_OPERATIONS): "mpi" makes
    #: an "auto" backend MPI; the others leave the native transport in Gloo's or oneCCL's place.
    cpu_operations: Optional[str] = None
    #: The timeline marks every fusion cycle's start (HOROVOD_TIMELINE_MARK_CYCLES).
    timeline_mark_cycles: bool = False
    #: Signatures the response cache keeps, at least 1 (HOROVOD_CACHE_CAPACITY; Horovod's
    #: 0 turns its cache off, which this engine cannot: its ranks agree through it).
    cache_capacity: int = 1024
    #: No stall reports and no stall shutdown (HOROVOD_STALL_CHECK_DISABLE).
    stall_check_disable: bool = False
    #: Tune the fusion threshold and the cycle time online (HOROVOD_AUTOTUNE and its
    #: _LOG, _WARMUP_SAMPLES, _STEPS_PER_SAMPLE, _BAYES_OPT_MAX_SAMPLES,
    #: _GAUSSIAN_PROCESS_NOISE; collectives/fusion/autotune.py).
    autotune: bool = False
    autotune_log: Optional[str] = None
    autotune_warmup_samples: int = 3
    autotune_steps_per_sample: int = 10
    autotune_bayes_opt_max_samples: int = 20
    autotune_gaussian_process_noise: float = 0.8
    #: "auto", "native", "mpi" or "nccl" (HOROVOD_SPARK_BACKEND).
    backend: str = "auto"
    #: Treat every rank as its own host, so the TCP path runs on one machine.
    force_tcp: bool = False
    #: Bytes of shared-memory staging per local rank.
    shm_slot_bytes: int = 4 * 1024 * 1024
    #: Large allreduces between ranks of one host read the peers' buffers in place
    #: (cross-memory attach), where the kernel allows it; False on any rank: never.
    shm_cma: bool = True
    #: What the native TCP transport tags after the handshake: "control", "payload" or "off"
    #: (HOROVOD_SPARK_MESH_INTEGRITY; docs/security.md).
    mesh_integrity: str = "control"

    def __post_init__(self) -> None:
        for name in ("timeout", "connect_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Config.{name} must be > 0, got {getattr(self, name)!r}")
        if self.fusion_threshold < 0:
            raise ValueError(f"Config.fusion_threshold must be >= 0 bytes, got {self.fusion_threshold}")
        if self.cycle_time_ms < 0:
            raise ValueError(f"Config.cycle_time_ms must be >= 0, got {self.cycle_time_ms}")
        if self.mesh_integrity not in MESH_INTEGRITY:
            raise ValueError(f"Config.mesh_integrity must be control, payload or off, got "
                             f"{self.mesh_integrity!r} (HOROVOD_SPARK_MESH_INTEGRITY)")
        if self.backend not in ("auto", "native", "mpi", "nccl"):
            raise ValueError(f"Config.backend must be auto, native, mpi or nccl, got {self.backend!r}")
        try:  # a level name in any case, Horovod's TRACE and FATAL too
            object.__setattr__(self, "log_level", parse_log_level(str(self.log_level)))
        except ValueError as exc:
            raise ValueError(f"Config.log_level {self.log_level!r}: {exc}") from None
        if self.cache_capacity < 1:
            raise ValueError(f"Config.cache_capacity must be >= 1, got {self.cache_capacity}")
        if self.shm_slot_bytes < 4096:
            raise ValueError(f"Config.shm_slot_bytes must be >= 4096, got {self.shm_slot_bytes}")

    @classmethod
    def create(cls, overrides: Optional[Mapping[str, Any]] = None,
               env: Optional[Mapping[str, str]] = None) -> "Config":
        """Arguments win over the environment, which wins over defaults."""
        env = os.environ if env is None else env
        values = {s.field: s.read(env) for s in SETTINGS if s.field and env.get(s.name, "") != ""}
        known = {f.name for f in dataclasses.fields(cls)}
        for key, val in (overrides or {}).items():
            if key not in known:
                raise ValueError(f"unknown config key {key!r}; known keys: {', '.join(sorted(known))}")
            values[key] = val
        if values.get("cpu_operations") == "mpi" and "backend" not in values:  # Horovod's way
            values["backend"] = "mpi"
        return cls(**values)

    def replace(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)
