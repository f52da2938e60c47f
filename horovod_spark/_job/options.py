"""A job's options, and the checks every face of the package makes of its arguments."""
from __future__ import annotations

import dataclasses
import sys
from typing import Mapping, Optional, Tuple

from ..settings import DriverSettings

__all__ = ["JobOptions", "env_items", "job_timeout", "start_timeout"]


def start_timeout(value: Optional[float], settings: DriverSettings) -> float:
    if value is None:  # Horovod's variable (600 s: only spent while executors come up)
        value = settings.start_timeout
    if value <= 0:
        raise ValueError(f"start_timeout must be > 0 seconds, got {value!r}")
    return float(value)


def job_timeout(value: Optional[float]) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"timeout must be a number of seconds > 0 (or None: no limit), "
                         f"got {value!r}")
    return float(value)


def env_items(env: Optional[Mapping[str, str]]):
    """The job's extra environment, refused here when a name or value could not be set."""
    if env is not None and not isinstance(env, Mapping):
        raise TypeError(f"env must be a mapping of variable names to values, got {type(env).__name__}")
    items = []
    for name, value in (env or {}).items():
        if not isinstance(name, str) or not name or "=" in name or "\0" in name:
            raise ValueError(f"env: {name!r} is not an environment variable name (a non-empty "
                             "string without '=' or NUL)")
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise TypeError(f"env[{name!r}] is {type(value).__name__} {value!r}: values must be "
                            "strings (or numbers); leave the name out to leave it unset")
        if "\0" in str(value):
            raise ValueError(f"env[{name!r}] holds a NUL character, which no environment can")
        items.append((name, str(value)))
    return tuple(items)


_start = start_timeout  # (JobOptions.of's argument has its name)


@dataclasses.dataclass(frozen=True)
class JobOptions:
    np: int
    env: Tuple[Tuple[str, str], ...] = ()
    stdout: object = None
    stderr: object = None
    show_output: bool = True
    rank0_only: bool = False
    start_timeout: float = 60.0
    verbose: int = 1
    max_restarts: int = 0
    timestamps: bool = False
    executable: Optional[str] = None
    settings: DriverSettings = DriverSettings()  # the driver's switches, read as the job starts
    timeout: Optional[float] = None   # seconds for the whole job (each attempt); None: none
    torch_layout: str = "hosts"       # torchrun's nodes: a host's ranks, or each task alone

    @classmethod
    def of(cls, np: int, env: Optional[Mapping[str, str]] = None,
           start_timeout: Optional[float] = None, timeout: Optional[float] = None,
           **fields) -> "JobOptions":
        """A job's options from its caller's arguments, the one way every face makes them:
        `env` checked (`env_items`), the driver's switches read with it (the driver's edge:
        each job reads them as it starts), `start_timeout` from HOROVOD_SPARK_START_TIMEOUT
        where unset and checked, `timeout` checked; the other fields as given."""
        env = env if isinstance(env, tuple) else env_items(env)
        settings = DriverSettings.read(env)
        return cls(np=np, env=env, settings=settings,
                   start_timeout=_start(start_timeout, settings), timeout=job_timeout(timeout),
                   **fields)

    def say(self, level: int, msg: str) -> None:
        if self.verbose >= level:
            print(f"horovod_spark: {msg}", file=self.stderr or sys.stderr, flush=True)
