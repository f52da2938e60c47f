"""Elastic training, the rank side: `State`, `ObjectState`, the `run` decorator, the link home.

Terms.  A *commit* saves the state in this process (`save`) and, where the job is elastic,
sends rank 0's saved copy to the driver's job store (the *link*), so it outlives the
attempt.  The driver hands the last committed copy to the next attempt's store together
with the *world* record (which attempt this is, its size, whether a commit came back);
`run` loads it on rank 0 and `sync()` gives it to every rank.  Under a launch that is not
elastic (`horovod_spark.run`, `collectives.launch`) there is no world record: commits stay
in memory, as Horovod's do under a launcher that is not elastic.  Frameworks add their
state (a model, an optimizer) in `torch.elastic` and `tensorflow.elastic`; the story is in
docs/elastic.md.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import json
from typing import Any, Callable, Dict, List, Optional

__all__ = ["State", "ObjectState", "run", "HostsUpdatedInterrupt", "World", "world_key",
           "commit_key", "grow_key"]


def world_key(job: str) -> str:
    return f"{job}/elastic/world"


def commit_key(job: str) -> str:
    return f"{job}/elastic/commit"


def grow_key(job: str) -> str:
    """Set by the driver when more barrier slots are free than the attempt has ranks: the
    ranks end the attempt at their next commit, and the next one has more of them."""
    return f"{job}/elastic/grow"


@dataclasses.dataclass(frozen=True)
class World:
    """What the driver tells an elastic attempt's ranks (JSON in the job store)."""
    attempt: int        # 0 for the first attempt
    size: int           # ranks in this attempt
    resumed: bool       # a committed state came back from an earlier attempt

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def decode(cls, blob: bytes) -> "World":
        return cls(**json.loads(blob.decode()))


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's signal that the hosts changed.  Raised on every rank by `commit()` (its
    `check_host_updates()`) when the driver offers more slots: the attempt ends there and
    the driver starts the next one, with more ranks, from that commit."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the hosts of the job changed")
        self.skip_sync = skip_sync


class _Link:
    """This rank's connection to the job store that keeps the committed state."""

    def __init__(self, store, job: str, world: World) -> None:
        self.store, self.job, self.world = store, job, world

    def committed(self) -> Optional[bytes]:
        key = commit_key(self.job)
        return self.store.get(key) if self.store.check(key) else None

    def grow_offered(self) -> bool:
        return self.store.check(grow_key(self.job))

    def commit(self, blob: bytes) -> None:
        from collectives.rendezvous.store import MAX_VALUE

        if len(blob) > MAX_VALUE:  # refused here: the store would drop the connection instead
            raise ValueError(f"elastic commit: the state is {len(blob)} bytes pickled, over the "
                             f"job store's largest value ({MAX_VALUE} bytes); keep less in the "
                             f"state (save large parts to shared storage and keep their path)")
        self.store.set(commit_key(self.job), blob)


_LINK: Dict[str, Optional[_Link]] = {}  # this process's link, once looked up (per job key)


def link() -> Optional[_Link]:
    """The link of this rank's elastic job, or None (no rank environment, or not elastic)."""
    from collectives.launch.rankenv import RankEnv

    renv = RankEnv.from_environ()
    if renv is None:
        return None
    if renv.job not in _LINK:
        from collectives.rendezvous.store import TCPStore

        store = TCPStore.connect(renv.store_addr, renv.secret)
        key = world_key(renv.job)
        if store.check(key):
            _LINK[renv.job] = _Link(store, renv.job, World.decode(store.get(key)))
        else:
            store.close()
            _LINK[renv.job] = None
    return _LINK[renv.job]


class State:
    """What survives a reset: saved by `commit()`, restored by `restore()`, made the same
    on every rank by `sync()`.

    Args:
        bcast_object: the adapter's broadcast_object(obj, root_rank).
        get_rank: the adapter's rank().
    """

    def __init__(self, bcast_object: Callable, get_rank: Callable[[], int]) -> None:
        self._bcast_object, self._rank = bcast_object, get_rank
        self._reset_callbacks: List[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: List[Callable[[], None]]) -> None:
        """Functions to call after a reset: when an attempt resumes from a commit (the
        world may have another size: scale the learning rate there)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float, update_res: Any = None) -> None:
        """Horovod's notification hook; here the driver's offer is read at each commit."""

    def commit(self) -> None:
        """Save the state and, in an elastic job, send rank 0's copy to the driver, so the
        next attempt resumes from here.  Every rank calls it at the same point."""
        self.save()
        home = link()
        if home is not None and self._rank() == 0:
            import cloudpickle

            home.commit(cloudpickle.dumps(self._snapshot()))
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """HostsUpdatedInterrupt on every rank when the driver offered more slots (rank 0
        reads the offer and broadcasts it, as Horovod broadcasts its host updates, so every
        rank raises at the same commit).  A barrier stage cannot take new tasks: the attempt
        ends here and the next one starts with more ranks from this commit.  Outside an
        elastic job: nothing (no collective either)."""
        home = link()
        if home is None:
            return
        offered = home.grow_offered() if self._rank() == 0 else None
        if self._bcast_object(offered):
            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def _snapshot(self) -> Any:
        """The saved state as a picklable value with no device tensors (what a commit sends)."""
        raise NotImplementedError

    def _load(self, snapshot: Any) -> None:
        """Make `snapshot` (a `_snapshot()` of an earlier attempt) the saved state."""
        raise NotImplementedError


class ObjectState(State):
    """Picklable attributes (`state.epoch`, `state.batch`, ...), saved by value.

    Args:
        bcast_object, get_rank: as `State`'s.
        **kwargs: the attributes and their first values.
    """

    def __init__(self, bcast_object: Callable, get_rank: Callable[[], int], **kwargs) -> None:
        super().__init__(bcast_object, get_rank)
        self._saved_state = copy.deepcopy(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)

    def save(self) -> None:
        self._saved_state = {name: copy.deepcopy(getattr(self, name)) for name in self._saved_state}

    def restore(self) -> None:
        self._restore_values()

    def _restore_values(self) -> None:
        for name, value in copy.deepcopy(self._saved_state).items():
            setattr(self, name, value)

    def sync(self) -> None:
        """Rank 0's saved values on every rank (a subclass's own state is synced by it: a
        restore() here would put back this rank's stale copy of it)."""
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._restore_values()

    def _snapshot(self) -> Any:
        return self._saved_state

    def _load(self, snapshot: Any) -> None:
        self._saved_state = dict(snapshot)


def run(func: Callable) -> Callable:
    """Horovod's `hvd.elastic.run`: `func(state, ...)` from the last commit on every rank.

    In an elastic job (`horovod_spark.run_elastic`), rank 0 loads the state the driver kept
    from an earlier attempt, `state.sync()` gives it to every rank, and the reset callbacks
    run; the first attempt just syncs.  A failure is not caught here: the attempt ends and
    the driver starts the next one; so does HostsUpdatedInterrupt (more slots offered,
    raised at a commit), with more ranks.
    """
    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        home = link()
        resumed = home is not None and home.world.resumed
        if resumed and state._rank() == 0:
            import cloudpickle

            blob = home.committed()
            if blob is None:
                raise RuntimeError(f"elastic attempt {home.world.attempt + 1}: the driver said a "
                                   f"committed state came back, but the job store has none "
                                   f"(key {commit_key(home.job)!r})")
            state._load(cloudpickle.loads(blob))
            state.restore()
        state.sync()
        if resumed:
            state.on_reset()
        return func(state, *args, **kwargs)

    return wrapper
