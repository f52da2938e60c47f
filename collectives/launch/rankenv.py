"""The rank environment: what every launcher hands a rank process.

Read once, at the edge (`collectives.init()`); see docs/architecture.md.  The job's
secret is not in it: the launchers of this package send it on the rank's own channel
(`channel.RankEnd`); HVS_SECRET is read only where no channel was given (a launch made
by hand), and leaves this process's environment when read.
"""
from __future__ import annotations

import dataclasses
import os
import socket
from typing import Mapping, Optional, Sequence

__all__ = ["RankEnv", "rank_envs"]

#: HVS_SECRET once read from this process's environment, which then drops it: the
#: training function's own subprocesses must not inherit the job's key.
_TAKEN: dict = {}


def _own_environ() -> Mapping[str, str]:
    from .channel import RankEnd

    end = RankEnd.of_this_process()
    if end is not None and "HVS_RANK" in os.environ:
        _TAKEN["HVS_SECRET"] = end.secret().hex()
    secret = os.environ.pop("HVS_SECRET", None)
    if secret is not None:
        _TAKEN["HVS_SECRET"] = secret
    return {**os.environ, **_TAKEN} if _TAKEN else os.environ


@dataclasses.dataclass(frozen=True)
class RankEnv:
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    host: str
    bind_addr: str
    store_addr: str
    secret: bytes
    job: str
    gpu_ordinal: Optional[int] = None  # the CUDA ordinal of this rank's own GPU, where assigned

    def __repr__(self) -> str:  # never print the secret
        return (f"RankEnv(rank={self.rank}, size={self.size}, local_rank={self.local_rank}, "
                f"host={self.host!r}, store={self.store_addr}, job={self.job!r})")

    @classmethod
    def from_environ(cls, environ: Optional[Mapping[str, str]] = None) -> Optional["RankEnv"]:
        env = _own_environ() if environ is None or environ is os.environ else environ
        if "HVS_RANK" not in env:
            return None
        try:
            return cls(rank=int(env["HVS_RANK"]), size=int(env["HVS_SIZE"]),
                       local_rank=int(env["HVS_LOCAL_RANK"]), local_size=int(env["HVS_LOCAL_SIZE"]),
                       cross_rank=int(env["HVS_CROSS_RANK"]), cross_size=int(env["HVS_CROSS_SIZE"]),
                       host=env["HVS_HOST"], bind_addr=env.get("HVS_BIND_ADDR", "127.0.0.1"),
                       store_addr=env["HVS_STORE_ADDR"], secret=bytes.fromhex(env["HVS_SECRET"]),
                       job=env["HVS_JOB"],
                       gpu_ordinal=int(env["HVS_GPU_ORDINAL"]) if env.get("HVS_GPU_ORDINAL")
                       else None)
        except (KeyError, ValueError) as exc:
            raise ValueError(f"incomplete rank environment ({exc}); a launcher sets every HVS_* "
                             "variable of docs/architecture.md") from None

    def to_environ(self) -> dict:
        """Every variable but the secret, which travels on the rank's channel."""
        return {
            "HVS_RANK": str(self.rank), "HVS_SIZE": str(self.size),
            "HVS_LOCAL_RANK": str(self.local_rank), "HVS_LOCAL_SIZE": str(self.local_size),
            "HVS_CROSS_RANK": str(self.cross_rank), "HVS_CROSS_SIZE": str(self.cross_size),
            "HVS_HOST": self.host, "HVS_BIND_ADDR": self.bind_addr,
            "HVS_STORE_ADDR": self.store_addr, "HVS_JOB": self.job,
            "HOROVOD_RANK": str(self.rank), "HOROVOD_SIZE": str(self.size),
            "HOROVOD_LOCAL_RANK": str(self.local_rank), "HOROVOD_LOCAL_SIZE": str(self.local_size),
            "HOROVOD_CROSS_RANK": str(self.cross_rank), "HOROVOD_CROSS_SIZE": str(self.cross_size),
            **({"HVS_GPU_ORDINAL": str(self.gpu_ordinal)} if self.gpu_ordinal is not None else {}),
        }


def rank_envs(np_: int, store_addr: str, secret: bytes, job: str,
              hosts: Optional[Sequence[str]] = None) -> list:
    """The rank environment of each of np_ local ranks (`hosts` fakes placement)."""
    hosts = list(hosts) if hosts else [socket.gethostname()] * np_
    if len(hosts) != np_:
        raise ValueError(f"hosts names {len(hosts)} hosts for {np_} ranks")
    order = list(dict.fromkeys(hosts))
    envs = []
    for r in range(np_):
        same = [i for i in range(np_) if hosts[i] == hosts[r]]
        envs.append(RankEnv(rank=r, size=np_, local_rank=same.index(r), local_size=len(same),
                            cross_rank=order.index(hosts[r]), cross_size=len(order),
                            host=hosts[r], bind_addr="127.0.0.1", store_addr=store_addr,
                            secret=secret, job=job))
    return envs
