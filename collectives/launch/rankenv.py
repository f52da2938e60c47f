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

__all__ = ["RankEnv", "rank_envs", "rank_env", "encode_hosts", "decode_hosts"]

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
    #: every rank's host, in rank order (HVS_HOSTS), where the launcher gave them: the
    #: mesh then needs no one's entry to know the world's placement
    hosts: tuple = ()

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
                       else None, hosts=decode_hosts(env.get("HVS_HOSTS", "")))
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
            **({"HVS_HOSTS": encode_hosts(self.hosts)} if self.hosts else {}),
        }


def encode_hosts(hosts: Sequence[str]) -> str:
    """Every rank's host as one short string: the distinct hosts in order of their first
    rank, space-separated, then ';' and each rank's host index, runs written `index*count`
    ("a b;0*4,1*4" for four ranks on a, then four on b)."""
    order = list(dict.fromkeys(hosts))
    at = {h: i for i, h in enumerate(order)}
    runs: list = []
    for h in hosts:
        if runs and runs[-1][0] == at[h]:
            runs[-1][1] += 1
        else:
            runs.append([at[h], 1])
    return " ".join(order) + ";" + ",".join(f"{i}*{n}" if n > 1 else str(i) for i, n in runs)


def decode_hosts(text: str) -> tuple:
    """`encode_hosts`'s string as the hosts, in rank order; () for ''."""
    if not text:
        return ()
    names, _, runs = text.partition(";")
    order = names.split(" ")
    out: list = []
    try:
        for run in runs.split(","):
            i, _, n = run.partition("*")
            out.extend([order[int(i)]] * (int(n) if n else 1))
    except (ValueError, IndexError):
        raise ValueError(f"HVS_HOSTS={text[:80]!r} does not parse") from None
    return tuple(out)


def rank_env(rank: int, hosts: Sequence[str], store_addr: str, secret: bytes, job: str,
             bind_addr: str = "127.0.0.1") -> RankEnv:
    """The rank environment of rank `rank` of len(hosts) ranks placed on `hosts`: its local
    rank among the ranks of its host, its host's index among the hosts in order of their
    first rank (one pass over the hosts: a task computes its own, not the world's)."""
    mine, order, local, local_size = hosts[rank], {}, 0, 0
    for r, h in enumerate(hosts):
        order.setdefault(h, len(order))
        if h == mine:
            local += r < rank
            local_size += 1
    return RankEnv(rank=rank, size=len(hosts), local_rank=local, local_size=local_size,
                   cross_rank=order[mine], cross_size=len(order), host=mine,
                   bind_addr=bind_addr, store_addr=store_addr, secret=secret, job=job,
                   hosts=tuple(hosts))


def rank_envs(np_: int, store_addr: str, secret: bytes, job: str,
              hosts: Optional[Sequence[str]] = None) -> list:
    """The rank environment of each of np_ local ranks (`hosts` fakes placement)."""
    hosts = list(hosts) if hosts else [socket.gethostname()] * np_
    if len(hosts) != np_:
        raise ValueError(f"hosts names {len(hosts)} hosts for {np_} ranks")
    return [rank_env(r, hosts, store_addr, secret, job) for r in range(np_)]
