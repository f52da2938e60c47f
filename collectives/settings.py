"""Every environment variable collectives reads, in one table.

A *switch* is a variable a user may set; each is read once, at its *edge*: the
process that reads it ("driver": the one that calls `run` or `fit`; "task": the
Spark task and its zygote; "rank": `collectives.init()`) reads it when it starts
and passes the typed value down.  A *contract* variable is one a launcher sets
for the rank process (RankEnv reads those as one record).  horovod_spark's own
rows use the same `Setting` (horovod_spark/_job/settings.py); the README and
docs/architecture.md list these tables, and a test holds them to it.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping, Optional

__all__ = ["Setting", "parse_bool", "parse_log_level", "SETTINGS", "CONTRACT", "WHERE",
           "ZYGOTE_IDLE_S", "WARM_REPORT", "FINISH_GRACE", "RETURN_RANKS"]

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


def _config(name: str, field: str, default: Any, parse: Callable[[str], Any], doc: str) -> Setting:
    return Setting(name, default, parse, "rank", doc, field=field)


ZYGOTE_IDLE_S = Setting("HOROVOD_SPARK_ZYGOTE_IDLE_S", 600.0, float, "task",
                        "seconds a zygote waits for the next job before it exits")
FINISH_GRACE = Setting("HOROVOD_SPARK_FINISH_GRACE_SECONDS", 60.0, parse_grace, "driver",
                       "once a rank returned, seconds the others may run on; 0: for ever")
RETURN_RANKS = Setting("HVS_RETURN_RANKS", None, str, "rank", "the ranks whose value is pickled "
                       "back, comma-separated (unset: every rank)", contract=True)
WARM_REPORT = Setting("HVS_WARM_REPORT", None, str, "rank", "modules whose import the worker "
                      "reports to the task (warm starts)", contract=True)

#: The user's switches of collectives: the rank reads those with a field in Config.create.
SETTINGS = (
    _config("HOROVOD_FUSION_THRESHOLD", "fusion_threshold", 64 * 1024 * 1024, int,
            "largest fusion buffer, in bytes"),
    _config("HOROVOD_CYCLE_TIME", "cycle_time_ms", 1.0, float,
            "milliseconds between the fusion engine's cycles"),
    _config("HOROVOD_TIMELINE", "timeline", None, str, "path of a Chrome-trace timeline (rank 0)"),
    _config("HOROVOD_STALL_CHECK_TIME_SECONDS", "stall_check_time", 60.0, float,
            "seconds before a tensor some ranks never submit is reported"),
    _config("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "stall_shutdown_time", 120.0, float,
            "seconds of stall before the ops that wait fail; 0: never"),
    _config("HOROVOD_LOG_LEVEL", "log_level", "WARNING", parse_log_level,
            "Python logging level of the collectives and horovod_spark loggers on the ranks"),
    _config("HOROVOD_SPARK_TIMEOUT", "timeout", 30.0, float,
            "seconds without progress from a peer before an op raises CollectiveTimeout"),
    _config("HOROVOD_SPARK_CONNECT_TIMEOUT", "connect_timeout", 60.0, float,
            "seconds to reach the store and the peers at start-up"),
    _config("HOROVOD_SPARK_BACKEND", "backend", "auto", str.lower, "auto, native, mpi or nccl"),
    _config("HOROVOD_SPARK_FORCE_TCP", "force_tcp", False, parse_bool,
            "every rank a host of its own, so one machine takes the TCP path"),
    _config("HOROVOD_SPARK_SHM_SLOT_BYTES", "shm_slot_bytes", 4 * 1024 * 1024, int,
            "bytes of shared-memory staging per local rank"),
    _config("HOROVOD_SPARK_SHM_CMA", "shm_cma", True, parse_bool,
            "large allreduces within a host read the peers' buffers in place"),
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
)) + (WARM_REPORT, RETURN_RANKS)
