"""One typed, frozen configuration per run.

Built from arguments first, then the environment (Horovod's names where they
exist; the rows of collectives.settings.SETTINGS that name a field), read when a
rank makes its communicator.  Unknown keys are rejected with the list of known
ones, so a typo never silently falls back to a default.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional

from .settings import SETTINGS, parse_log_level

__all__ = ["Config"]


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
    #: "auto", "native", "mpi" or "nccl" (HOROVOD_SPARK_BACKEND).
    backend: str = "auto"
    #: Treat every rank as its own host, so the TCP path runs on one machine.
    force_tcp: bool = False
    #: Bytes of shared-memory staging per local rank.
    shm_slot_bytes: int = 4 * 1024 * 1024
    #: Large allreduces between ranks of one host read the peers' buffers in place
    #: (cross-memory attach), where the kernel allows it; False on any rank: never.
    shm_cma: bool = True

    def __post_init__(self) -> None:
        for name in ("timeout", "connect_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Config.{name} must be > 0, got {getattr(self, name)!r}")
        if self.fusion_threshold < 0:
            raise ValueError(f"Config.fusion_threshold must be >= 0 bytes, got {self.fusion_threshold}")
        if self.cycle_time_ms < 0:
            raise ValueError(f"Config.cycle_time_ms must be >= 0, got {self.cycle_time_ms}")
        if self.backend not in ("auto", "native", "mpi", "nccl"):
            raise ValueError(f"Config.backend must be auto, native, mpi or nccl, got {self.backend!r}")
        try:  # a level name in any case, Horovod's TRACE and FATAL too
            object.__setattr__(self, "log_level", parse_log_level(str(self.log_level)))
        except ValueError as exc:
            raise ValueError(f"Config.log_level {self.log_level!r}: {exc}") from None
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
        return cls(**values)

    def replace(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)
