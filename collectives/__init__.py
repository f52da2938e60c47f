"""Framework-free collective communication: the Communicator and its backends.

    import collectives
    comm = collectives.init()          # from the launcher's rank environment
    total = comm.allreduce(np.ones(4, np.float32))
"""
from __future__ import annotations

import itertools
import logging
import os
import socket
from typing import Mapping, Optional

from ._version import __version__
from .launch.rankenv import RankEnv
from .logs import apply_log_level
from .communicator import Communicator, Work
from .settings import Config
from .errors import (AuthenticationError, CollectiveError, CollectiveTimeout, MismatchError,
                     NotSupported, PeerLostError)
from .types import DType, ReduceOp

__all__ = [
    "init", "Communicator", "Work", "Config", "RankEnv", "ReduceOp", "DType",
    "CollectiveError", "PeerLostError", "CollectiveTimeout", "MismatchError", "NotSupported",
    "AuthenticationError", "__version__",
]

_generation = itertools.count()
_made = []  # the communicators this process asked for (their generations)
log = logging.getLogger("collectives")


def joined() -> bool:
    """Whether this process ever called init() (a rank that returns without it is announced
    to the others, who would wait for it at theirs: `rendezvous.mesh.announce_returned`)."""
    return bool(_made)


def init(config: Optional[Config] = None, environ: Optional[Mapping[str, str]] = None, *,
         group: Optional[str] = None, rank: Optional[int] = None,
         size: Optional[int] = None) -> Communicator:
    """A Communicator for this process, from the rank environment the launcher set.

    Under `collectives.launch` or the Spark runner: the native backend over the
    launcher's store.  Under `mpiexec` (or with backend "mpi"): the MPI backend.
    Otherwise a world of one.  Every rank must call init() the same number of times.
    This is the rank's edge: the environment's settings are read here (Config.create,
    RankEnv) and HOROVOD_LOG_LEVEL applied to the `collectives` loggers.

    `group`: a communicator of a group the caller names (a torch.distributed group), over
    the launcher's store under a key prefix of its own, as member `rank` of `size` (the
    world's rank and size by default); the members call it with the same name.  No
    communicator of the world is made, and the world's init() count is not changed.
    """
    environ = os.environ if environ is None else environ
    config = config or Config.create(env=environ)
    renv = RankEnv.from_environ(environ)
    if group is not None:
        if renv is None:
            raise ValueError(f"init(group={group!r}): no rank environment (HVS_RANK ...) to "
                             f"make the group's communicator from; a launcher of this package "
                             f"sets it")
        return _group_communicator(config, renv, group, rank, size)
    if renv is not None:
        apply_log_level(config.log_level, renv.rank, renv.size, hide_time=config.log_hide_time)
    comm = _communicator(config, environ, renv)
    if renv is None:
        apply_log_level(config.log_level, comm.rank, comm.size, hide_time=config.log_hide_time)
    log.info("rank %d/%d joined on host %s: %s backend", comm.rank, comm.size,
             comm.backend.topology.hosts[comm.rank], type(comm.backend).__name__)
    log.debug("rank %d/%d config: %s", comm.rank, comm.size, config)
    return comm


def _group_communicator(config: Config, renv: RankEnv, group: str, rank: Optional[int],
                        size: Optional[int]) -> Communicator:
    from .rendezvous.store import TCPStore

    rank = renv.rank if rank is None else int(rank)
    size = renv.size if size is None else int(size)
    store = TCPStore.connect(renv.store_addr, renv.secret, config.connect_timeout)
    world = renv.hosts if size == renv.size and rank == renv.rank else ()  # its placement
    _made.append(group)
    return Communicator.create(store, rank, size, renv.host, renv.bind_addr, renv.secret,
                               f"{renv.job}/{group}", config, hosts=world)


def _communicator(config: Config, environ: Mapping[str, str], renv: Optional[RankEnv]) -> Communicator:
    gen = next(_generation)
    _made.append(gen)
    if renv is not None and config.backend != "mpi":
        from .rendezvous.store import TCPStore

        store = TCPStore.connect(renv.store_addr, renv.secret, config.connect_timeout)
        return Communicator.create(store, renv.rank, renv.size, renv.host, renv.bind_addr,
                                   renv.secret, f"{renv.job}/comm{gen}", config,
                                   hosts=renv.hosts)
    from .backends import mpi

    if config.backend == "mpi" or mpi.launched_by_mpiexec(environ):
        return Communicator(mpi.MpiBackend.from_world(config), config)
    from .rendezvous.auth import new_secret
    from .rendezvous.store import InMemoryStore

    return Communicator.create(InMemoryStore(), 0, 1, socket.gethostname(), "127.0.0.1",
                               new_secret(), f"single/comm{gen}", config)
