"""Process sets: collectives among a subset of the ranks, as Horovod has them.

Terms.  A *process set* is a sorted list of world ranks with an id (the
global set, every rank, is id 0).  Its *members* are its ranks; a member's
*set rank* is its index in the list.  A *view* is what an op needs of a set
on this rank: its engine, set rank and size, and the world-to-set mapping of a
root.

Each set other than the global one has, on its members, a communicator of
its own (`collectives.subgroup`: its own sockets and shared memory, built
through the job's store) and a fusion engine of its own over it, so its ops
are negotiated among its members only and run concurrently with the world's
and other sets' ops.  Non-members hold only the set's ranks and id.

Registration is collective over the world, as Horovod's: every rank adds the
same sets in the same order (`hvd.init(process_sets=[...])`, or
`add_process_set` with dynamic sets on).  Each registration first allgathers,
through the global engine, how many sets every rank adds and each one's
membership mask, so a disagreement is an error naming every rank's sets, on
every rank, instead of a hang.  Removal agrees on the id the same way, then
the members stop the set's engine and close its communicator (its sockets,
segment and thread go with them).  Ids are the smallest free, so every rank
numbers alike; store keys use a count of registrations, never reused.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import threading
from typing import Dict, List, Optional, Sequence

import numpy as np

from collectives.errors import CollectiveError
from collectives.subgroup import check_subset

__all__ = ["ProcessSet", "ProcessSetTable", "SetView", "DYNAMIC_HINT"]

DYNAMIC_HINT = ("set HOROVOD_DYNAMIC_PROCESS_SETS=1 in every rank's environment or call "
                "hvd.init(process_sets='dynamic'); or pass the sets to "
                "hvd.init(process_sets=[...]) on every rank")


class ProcessSet:
    """A set of ranks that run collectives together (Horovod's `hvd.ProcessSet`).

    Make one from a list of world ranks (or an mpi4py communicator), then pass it to
    `hvd.init(process_sets=[...])` or `hvd.add_process_set`; after that its
    `process_set_id` is set and ops take it as `process_set=`.
    """

    def __init__(self, ranks_or_comm) -> None:
        self.process_set_id: Optional[int] = None
        self.mpi_comm = None
        self._table: "Optional[ProcessSetTable]" = None
        if hasattr(ranks_or_comm, "Get_group"):  # an mpi4py communicator
            self.mpi_comm = ranks_or_comm
            ranks_or_comm = _world_ranks_of(ranks_or_comm)
        try:
            ranks = sorted(ranks_or_comm)
        except TypeError:
            raise ValueError(f"ProcessSet takes a list of ranks or an mpi4py communicator, got "
                             f"{ranks_or_comm!r}") from None
        if any(not isinstance(r, (int, np.integer)) or isinstance(r, bool) for r in ranks):
            raise ValueError(f"ProcessSet takes a list of ranks (ints), got {list(ranks_or_comm)}")
        self.ranks: Optional[List[int]] = [int(r) for r in ranks]

    def size(self) -> Optional[int]:
        """How many ranks the set has, or None before it is registered."""
        return None if self._registered() is None else len(self.ranks)

    def rank(self) -> Optional[int]:
        """This rank's index in the set (what orders an allgather's result), or None before
        registration.  Ops take world ranks (hvd.rank()) as roots, not these.

        Raises:
            ValueError: this rank is not a member.
        """
        table = self._registered()
        if table is None:
            return None
        me = table.world_rank()
        if me not in self.ranks:
            raise ValueError(f"world rank {me} is not in process set {self.process_set_id} "
                             f"(ranks {self.ranks}); see included()")
        return self.ranks.index(me)

    def included(self) -> Optional[bool]:
        """Whether this rank is a member, or None before the set is registered."""
        table = self._registered()
        return None if table is None else table.world_rank() in self.ranks

    def _registered(self) -> "Optional[ProcessSetTable]":
        table = self._table
        if table is None or self.process_set_id is None or not table.live():
            return None
        return table

    def _invalidate(self) -> None:
        self.process_set_id, self._table = None, None

    def __repr__(self) -> str:
        return (f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
                f"mpi_comm={self.mpi_comm})")

    __str__ = __repr__


def _world_ranks_of(comm) -> List[int]:
    from mpi4py import MPI

    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return [int(r) for r in MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world)]
    finally:
        group.Free()
        world.Free()


def _a_split(column: np.ndarray) -> bool:
    """Each rank's set (row r) holds rank r, and every member of it passed the same set."""
    return all(column[r, r] and all((column[m] == column[r]).all()
                                    for m in np.flatnonzero(column[r]))
               for r in range(len(column)))


@dataclasses.dataclass
class SetView:
    """One set as this rank's ops see it (see the module docstring)."""

    id: int
    ranks: List[int]
    rank: int
    size: int
    label: str
    tag: int = 0  # the registration's number: unique for the job, unlike a reused id
    comm: object = None
    engine: object = None
    sets: list = dataclasses.field(default_factory=list)  # the ProcessSet objects with this id

    def root(self, world_root: int, what: str) -> int:
        """The set rank of a root given as a world rank (Horovod's root_rank)."""
        if world_root not in self.ranks:
            raise ValueError(f"{what}: root_rank {world_root} is not in {self.label}")
        return self.ranks.index(int(world_root))

    def submit(self, name: str, kind: str, *args, **kwargs):
        """The set engine's submit; its errors say which set they come from."""
        try:
            return _SetHandle(self.engine.submit(name, kind, *args, **kwargs), self.label)
        except (CollectiveError, ValueError) as exc:
            raise _in_set(exc, self.label) from exc


class _SetHandle:
    """A set engine's handle whose error names the set (its ranks are set ranks)."""

    __slots__ = ("_h", "_label")

    def __init__(self, handle, label: str) -> None:
        self._h, self._label = handle, label

    def wait(self, timeout: Optional[float] = None):
        try:
            return self._h.wait(timeout)
        except CollectiveError as exc:
            raise _in_set(exc, self._label) from exc

    def poll(self) -> bool:
        return self._h.poll()

    def exception(self):
        return self._h.exception()


def _in_set(exc: BaseException, label: str) -> BaseException:
    err = copy.copy(exc)
    err.args = (f"in {label}: {exc}",) + tuple(exc.args[1:])
    return err


def _label(set_id: int, ranks: Sequence[int], me: int) -> str:
    where = f"set rank {ranks.index(me)} of {len(ranks)}" if me in ranks else "not a member"
    return (f"process set {set_id} of world ranks {list(ranks)} (this is world rank {me}, "
            f"{where}; rank numbers below are set ranks)")


class ProcessSetTable:
    """The sets one adapter's state registered (see the module docstring).

    Args:
        world: returns the world communicator (raises when not initialized).
        engine: returns the global fusion engine.
        global_set: the adapter's `global_process_set` object (id 0).
    """

    def __init__(self, world, engine, global_set: ProcessSet) -> None:
        self._world, self._engine = world, engine
        self._lock = threading.Lock()
        self._views: Dict[int, SetView] = {}
        self._adds = itertools.count()
        self._ops = itertools.count()
        self.dynamic = False
        self._live = False
        global_set.process_set_id, global_set._table = 0, self
        self.global_set = global_set

    # -- lifecycle ---------------------------------------------------------------
    def start(self, dynamic: bool) -> None:
        """At init(): the global set covers the world."""
        comm = self._world()
        self.dynamic, self._live = dynamic, True
        self.global_set.ranks = list(range(comm.size))
        self.global_set.process_set_id, self.global_set._table = 0, self

    def live(self) -> bool:
        return self._live

    def world_rank(self) -> int:
        return self._world().rank

    def close(self) -> None:
        """At shutdown(): every set's engine and communicator, before the world's."""
        with self._lock:
            views, self._views, self._live = list(self._views.values()), {}, False
        for view in views:
            _release(view)

    # -- registration ------------------------------------------------------------
    def add(self, sets: Sequence, initial: bool = False) -> List[ProcessSet]:
        """Register `sets` (ProcessSets or lists of ranks) on every rank, in order."""
        if not initial and not self.dynamic:
            raise ValueError("add_process_set: dynamic process sets are off; " + DYNAMIC_HINT)
        comm = self._world()
        sets = [s if isinstance(s, ProcessSet) else ProcessSet(s) for s in sets]
        for ps in sets:
            check_subset(ps.ranks, comm.size)
        registered = []
        for ps, (mine, masks) in zip(sets, self._agree_on_masks(sets, comm)):
            for mask in masks:  # one set, or the parts a split communicator made (see below)
                if (mask == mine).all():
                    registered.append(self._register(ps, mask, comm, initial))
                else:  # another rank's part: registered here too, with this rank outside it
                    self._register(ProcessSet(np.flatnonzero(mask).tolist()), mask, comm, initial)
        return registered

    def _agree_on_masks(self, sets: List[ProcessSet], comm) -> list:
        """Per set: (this rank's membership mask, the masks to register).  Every rank must
        pass the same ranks, except for sets made from mpi4py communicators that split the
        world (Horovod's `COMM_WORLD.Split`): each rank's holds it, and their members agree,
        so each distinct one is registered, in the order of its lowest rank."""
        op = next(self._ops)
        counts = self._gather(f"process_set.{op}.count", np.array([len(sets)], np.int64))
        if len(set(counts.tolist())) != 1:
            raise ValueError(f"ranks add different numbers of process sets ("
                             + ", ".join(f"rank {r}: {int(n)}" for r, n in enumerate(counts))
                             + "); every rank must add the same sets in the same order")
        width = comm.size + 1  # the membership, then whether it came from a communicator
        mine = np.zeros((len(sets), width), np.uint8)
        for i, ps in enumerate(sets):
            mine[i, ps.ranks] = 1
            mine[i, -1] = ps.mpi_comm is not None
        if not sets:
            return []
        every = self._gather(f"process_set.{op}.ranks", mine.reshape(-1))
        every = every.reshape(comm.size, len(sets), width)
        out = []
        for i in range(len(sets)):
            column = every[:, i, :-1]
            if (column == column[0]).all():
                out.append((mine[i, :-1], [column[0]]))
                continue
            if every[:, i, -1].all() and _a_split(column):
                firsts = sorted({int(np.flatnonzero(m)[0]) for m in column})
                out.append((mine[i, :-1], [column[r] for r in firsts]))
                continue
            said = ", ".join(f"rank {r}: {np.flatnonzero(column[r]).tolist()}"
                             for r in range(comm.size))
            raise ValueError(f"ranks disagree on process set #{i + 1} of this call ({said}); "
                             "every rank must add the same sets in the same order (sets from "
                             "mpi4py communicators may differ where each rank is in its own, "
                             "as COMM_WORLD.Split makes them)")
        return out

    def _gather(self, name: str, a: np.ndarray) -> np.ndarray:
        return np.asarray(self._engine().submit(name, "allgather", a, lazy=True).wait())

    def _register(self, ps: ProcessSet, mask: np.ndarray, comm, initial: bool) -> ProcessSet:
        """One agreed set; at init() a set registered already (the global one too) is that
        set, as Horovod's init() takes it, while add_process_set refuses it."""
        ranks = np.flatnonzero(mask).tolist()
        with self._lock:
            same = [v for v in self._views.values() if v.ranks == ranks]
            if initial and (same or ranks == self.global_set.ranks):
                ps.ranks, ps.process_set_id, ps._table = ranks, same[0].id if same else 0, self
                if same:
                    same[0].sets.append(ps)
                return ps
            if ranks == self.global_set.ranks:
                raise ValueError(f"add_process_set: ranks {ranks} are the global process set "
                                 "(hvd.global_process_set); use that one")
            if same:
                raise ValueError(f"add_process_set: a process set of ranks {ranks} is already "
                                 f"registered (id {same[0].id}); remove it first or use that one")
            set_id = next(i for i in itertools.count(1) if i not in self._views)
            view = SetView(set_id, ranks, ranks.index(comm.rank) if comm.rank in ranks else -1,
                           len(ranks), _label(set_id, ranks, comm.rank), next(self._adds),
                           sets=[ps])
            self._views[set_id] = view
        if view.rank >= 0:
            try:
                view.comm, view.engine = _member_engine(comm, ranks, view.tag)
            except BaseException:
                with self._lock:
                    self._views.pop(set_id, None)
                raise
        ps.ranks, ps.process_set_id, ps._table = ranks, set_id, self
        return ps

    def remove(self, ps: ProcessSet) -> bool:
        """Unregister `ps` on every rank; False for the global set or one not registered."""
        if not self.dynamic:
            raise ValueError("remove_process_set: dynamic process sets are off; " + DYNAMIC_HINT)
        set_id = ps.process_set_id
        if set_id == 0 or set_id is None or ps._table is not self:
            return False
        ids = self._gather(f"process_set.{next(self._ops)}.remove", np.array([set_id], np.int64))
        if len(set(ids.tolist())) != 1:
            raise ValueError("ranks remove different process sets (" + ", ".join(
                f"rank {r}: id {int(i)}" for r, i in enumerate(ids)) + "); every rank must remove "
                "the same sets in the same order")
        with self._lock:
            view = self._views.pop(set_id, None)
        if view is None:
            return False
        try:
            _release(view)
        finally:
            for other in view.sets + [ps]:
                other._invalidate()
        return True

    # -- ops -----------------------------------------------------------------------
    def view(self, ps, what: str) -> Optional[SetView]:
        """The view of `ps` for an op on this rank; None for the global set.

        Raises:
            ValueError: `ps` is not a registered set, or this rank is not one of its members.
        """
        if ps is None or ps is self.global_set:
            return None
        if isinstance(ps, SetView):  # resolved already (an adapter's internal call)
            return ps
        set_id = getattr(ps, "process_set_id", False)
        if set_id == 0:
            return None
        if set_id is False:
            raise TypeError(f"{what}: process_set takes a hvd.ProcessSet, got {type(ps).__name__}")
        view = self._views.get(set_id) if set_id is not None else None
        if view is None or view.ranks != ps.ranks:
            raise ValueError(f"{what}: {ps!r} is not registered (or was removed); pass it to "
                             "hvd.init(process_sets=[...]) or hvd.add_process_set first")
        if view.engine is None:
            raise ValueError(f"{what}: world rank {self.world_rank()} is not a member of "
                             f"process set {set_id} (ranks {view.ranks}); only its members "
                             "call ops on it")
        if ps not in view.sets:
            view.sets.append(ps)
        return view

    def ranks_of(self, set_id: int) -> Optional[List[int]]:
        if set_id == 0:
            return list(self.global_set.ranks)
        view = self._views.get(set_id)
        return None if view is None else list(view.ranks)

    def process_sets(self) -> List[ProcessSet]:
        with self._lock:
            return [self.global_set] + [v.sets[0] for _, v in sorted(self._views.items())]


def _member_engine(comm, ranks: List[int], tag: int):
    from collectives.fusion import FusionEngine

    sub = comm.subset(ranks, f"pset{tag}")
    try:  # one timeline per job: the global set's
        return sub, FusionEngine(sub, dataclasses.replace(sub.config, timeline=None))
    except BaseException:
        sub.close()
        raise


def _release(view: SetView) -> None:
    try:
        if view.engine is not None:
            view.engine.shutdown()
    finally:
        if view.comm is not None:
            view.comm.close()
