"""Sub-communicators: a communicator of its own among some ranks of another.

A *subset* is a sorted list of distinct world ranks; its *members* are those
ranks, and member i is rank i of the sub-communicator.  The members bootstrap
it as the world was bootstrapped, through the world's store under a key prefix
of its own (the world's prefix, then `sub/<tag>`): a mesh of authenticated TCP
connections among the members only, and a shared-memory segment per group of
members that share a /dev/shm.  So it has its own sockets, segment and
sequence numbers, and its ops never interleave with the world's or another
subset's: ops on two subsets may run at once, from two threads, even where the
subsets overlap.  Closing it releases all of that.

Non-members take no part: the caller decides membership (every rank knows the
subset) and only members call `sub_communicator`.

Under the MPI backend (ranks started by mpiexec, no store) the members make an MPI
communicator of their own instead (`MPI_Comm_create_group` over the world's private
duplicate, collective over the members only), and the sub-communicator's MPI backend
duplicates it: the same separation of traffic, MPI's way.
"""
from __future__ import annotations

from typing import Sequence

from .errors import NotSupported, describe

__all__ = ["sub_communicator", "check_subset"]


def check_subset(ranks: Sequence[int], size: int) -> list:
    """`ranks` as a sorted list of distinct world ranks, or ValueError naming what is wrong."""
    try:
        out = sorted(int(r) for r in ranks)
    except (TypeError, ValueError):
        raise TypeError(f"a subset is a list of ranks (ints), got {ranks!r}") from None
    if not out:
        raise ValueError("a subset needs at least one rank, got []")
    if len(set(out)) != len(out):
        raise ValueError(f"a subset lists each rank once, got {list(ranks)}")
    if out[0] < 0 or out[-1] >= size:
        raise ValueError(f"ranks {list(ranks)} are not all in the world of size {size} "
                         f"(ranks 0..{size - 1})")
    return out


def sub_communicator(comm, ranks: Sequence[int], tag: str):
    """The sub-communicator among `ranks`, built by its members (see the module docstring).

    Raises:
        ValueError: bad ranks, or this rank is not one of them.
        NotSupported: `comm` was neither bootstrapped through a store nor runs on MPI.
        CollectiveError: a member never came (named, within the connect timeout).
    """
    ranks = check_subset(ranks, comm.size)
    if comm.rank not in ranks:
        raise ValueError(f"rank {comm.rank}/{comm.size} is not in the subset {ranks}; only its "
                         "members build its communicator")
    if comm.backend_name == "mpi":
        return _mpi_sub_communicator(comm, ranks, tag)
    if comm._boot is None or comm._store is None:
        raise NotSupported(describe(
            f"sub-communicators need the native backend, this one is {comm.backend_name}",
            rank=comm.rank, size=comm.size, op="subset",
            hint="start the ranks with horovod_spark or collectives.launch rather than mpiexec"))
    host, bind_addr, secret = comm._boot
    return type(comm).create(comm._store, ranks.index(comm.rank), len(ranks), host, bind_addr,
                               secret, f"{comm._prefix}/sub/{tag}", comm.config)


def _mpi_sub_communicator(comm, ranks: list, tag: str):
    """The members' MPI communicator (see the module docstring), in a Communicator."""
    import zlib

    from .backends.mpi import MpiBackend

    world = comm.backend.comm
    everyone = world.Get_group()
    group = everyone.Incl(ranks)
    try:  # an MPI tag from the subset's name: the members agree on it, others never see it
        members = world.Create_group(group, zlib.crc32(tag.encode()) % 32768)
    finally:
        group.Free()
        everyone.Free()
    try:
        backend = MpiBackend.from_world(comm.config, members)  # its own duplicate
    finally:
        members.Free()
    return type(comm)(backend, comm.config)
