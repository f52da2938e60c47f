"""The Horovod basics both adapters share: one communicator, one fusion engine.

Each adapter (`horovod_spark.torch`, `horovod_spark.tensorflow`) owns one
`HorovodState` and exports its bound methods as Horovod's module-level
functions (`hvd.init`, `hvd.rank`, ...).  `init()` builds the communicator
from the rank environment the launcher set (the local launcher, the Spark
task, mpiexec; a world of one otherwise) and starts the fusion engine over
it, so ops from any thread are negotiated, fused and timed; `shutdown()`
stops the engine on every rank and closes the communicator.

A state pickles as a reference to its adapter's module, so a function that
captured `hvd.rank` runs against the rank process's own state.  Nothing here
imports a framework.
"""
from __future__ import annotations

import atexit
import importlib
import importlib.util
import logging
import threading
from typing import Callable, Optional

import collectives
from collectives.fusion import FusionEngine
from collectives.logs import apply_log_level

from .. import progress
from .process_sets import ProcessSet, ProcessSetTable, SetView

__all__ = ["HorovodState", "BASICS", "gpu_ordinal", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built",
           "ddl_built", "ccl_built"]

log = logging.getLogger("horovod_spark")


def gpu_ordinal() -> "Optional[int]":
    """The CUDA ordinal of this rank's own GPU where the Spark task assigned one (the task
    makes every GPU of the ranks on its host visible, in local-rank order), else None.
    The adapters' init() makes it the framework's current device."""
    from collectives.launch.rankenv import RankEnv

    renv = RankEnv.from_environ()
    return None if renv is None else renv.gpu_ordinal


def _state_of(module: str) -> "HorovodState":
    return importlib.import_module(module).STATE


#: Horovod's basics: the names every adapter module takes from its state (HorovodState.bind)
BASICS = ("init", "shutdown", "is_initialized", "communicator", "engine", "rank", "size",
          "local_rank", "local_size", "cross_rank", "cross_size", "is_homogeneous",
          "start_timeline", "stop_timeline", "global_process_set", "add_process_set",
          "remove_process_set")


class HorovodState:
    """The communicator and engine of one adapter.

    Args:
        package: the adapter's public name, for the not-initialized message.
        module: the module whose `STATE` is this object (what pickles refer to).
        on_init: called under the lock when init() has made a new communicator.
        lane: give the engine its C++ lane (`collectives.fusion.lane.Lane`), for an adapter
            whose ops call it from C++ (TensorFlow's).
    """

    def __init__(self, package: str, module: str, on_init: Optional[Callable[[], None]] = None,
                 lane: bool = False) -> None:
        self.package, self.module, self._on_init, self._lane = package, module, on_init, lane
        self._lock = threading.Lock()
        self._comm: Optional[collectives.Communicator] = None
        self._engine: Optional[FusionEngine] = None
        #: Horovod's `global_process_set` of this adapter, and the sets registered beside it
        self.global_process_set = ProcessSet([])
        self._psets = ProcessSetTable(self.communicator, self.engine, self.global_process_set)
        atexit.register(self.shutdown)
        progress.add_engine_source(self.collective_seconds)

    def __reduce__(self):
        return _state_of, (self.module,)

    def bind(self, namespace: dict) -> None:
        """Horovod's basics (BASICS) as names of an adapter's module, this state's own:
        `STATE.bind(globals())` makes its hvd.init, hvd.rank, hvd.global_process_set..."""
        for name in BASICS:
            namespace[name] = getattr(self, name)

    @property
    def not_initialized(self) -> str:
        return f"{self.package} has not been initialized; call hvd.init() first"

    def init(self, comm: Optional[collectives.Communicator] = None,
             config: Optional[collectives.Config] = None, process_sets=None) -> None:
        """Join the job (a no-op while initialized).

        Args:
            comm: an existing collectives.Communicator to use instead of building one.
            config: a collectives.Config; by default built from the HOROVOD_* variables.
            process_sets: ProcessSets (or lists of ranks) every rank registers now, in the
                same order; or "dynamic" to allow add_process_set/remove_process_set later
                (as HOROVOD_DYNAMIC_PROCESS_SETS=1 does).
        """
        with self._lock:
            if self._comm is not None:
                return
            self._start(comm, config)
        self._start_process_sets(process_sets)

    def _start_process_sets(self, process_sets) -> None:
        from ..settings import DYNAMIC_PROCESS_SETS

        dynamic = isinstance(process_sets, str)
        if dynamic and process_sets != "dynamic":
            raise ValueError(f"init(process_sets=...) takes a list of process sets or 'dynamic', "
                             f"got {process_sets!r}")
        self._psets.start(dynamic or DYNAMIC_PROCESS_SETS.read())
        if process_sets and not dynamic:
            self._psets.add(list(process_sets), initial=True)

    def _start(self, comm, config) -> None:
        if comm is not None and not isinstance(comm, collectives.Communicator):
            raise TypeError(f"init(comm=...) takes a collectives.Communicator, got "
                            f"{type(comm).__name__}; MPI sub-communicators are not supported")
        comm = comm if comm is not None else collectives.init(config)
        from ..progress import forward_warnings

        config = config if config is not None else comm.config
        for name in ("collectives", "horovod_spark"):  # under a Spark task: to the driver
            forward_warnings(name)
        apply_log_level(config.log_level, comm.rank, comm.size, ("collectives", "horovod_spark"),
                        hide_time=config.log_hide_time)
        self._engine = FusionEngine(comm, config, lane=self._lane)
        log.info("%s joined as rank %d/%d (fusion threshold %d B, cycle %g ms)", self.package,
                 comm.rank, comm.size, config.fusion_threshold, config.cycle_time_ms)
        self._comm = comm
        if self._on_init is not None:
            self._on_init()

    def shutdown(self) -> None:
        """Leave the job: stop the engines on every rank and close the communicators."""
        with self._lock:
            try:
                self._psets.close()
            finally:
                comm, eng, self._comm, self._engine = self._comm, self._engine, None, None
        try:
            if eng is not None:
                eng.shutdown()
        finally:
            if comm is not None:
                comm.close()

    def is_initialized(self) -> bool:
        return self._comm is not None

    def collective_seconds(self) -> Optional[float]:
        """Seconds the engine has spent inside collectives, or None before init()."""
        eng = self._engine
        return None if eng is None else float(eng.metrics().get("collective_s", 0.0))

    def communicator(self) -> collectives.Communicator:
        """The communicator, or ValueError when init() has not been called."""
        comm = self._comm
        if comm is None:
            raise ValueError(self.not_initialized)
        return comm

    def engine(self) -> FusionEngine:
        """The fusion engine, or ValueError when init() has not been called."""
        eng = self._engine
        if eng is None:
            raise ValueError(self.not_initialized)
        return eng

    def rank(self) -> int:
        return self.communicator().rank

    # -- process sets ------------------------------------------------------------
    def add_process_set(self, process_set) -> ProcessSet:
        """Register a set on every rank (collective; needs dynamic process sets)."""
        return self._psets.add([process_set])[0]

    def remove_process_set(self, process_set: ProcessSet) -> bool:
        """Unregister a set on every rank (collective); False for the global set."""
        return self._psets.remove(process_set)

    def process_set(self, process_set, what: str) -> Optional[SetView]:
        """The view an op on `process_set` runs on; None for the global set.

        Raises:
            ValueError: not a registered set, or this rank is not one of its members.
        """
        if process_set is None or process_set is self.global_process_set:
            return None
        self.communicator()
        return self._psets.view(process_set, what)

    def process_set_ranks(self, set_id: int) -> Optional[list]:
        """The ranks of the registered set with this id, or None."""
        self.communicator()
        return self._psets.ranks_of(int(set_id))

    def process_sets(self) -> list:
        """The registered sets, the global one first."""
        self.communicator()
        return self._psets.process_sets()

    def size(self) -> int:
        return self.communicator().size

    def local_rank(self) -> int:
        return self.communicator().local_rank

    def local_size(self) -> int:
        return self.communicator().local_size

    def cross_rank(self) -> int:
        return self.communicator().cross_rank

    def cross_size(self) -> int:
        return self.communicator().cross_size

    def is_homogeneous(self) -> bool:
        """Whether every host runs the same number of ranks."""
        topo = self.communicator().backend.topology
        counts = [topo.hosts.count(h) for h in topo.host_order]
        return len(set(counts)) == 1

    def start_timeline(self, file_path: str, mark_cycles: bool = False) -> None:
        """Start writing a Chrome-trace timeline of every op to file_path (rank 0 writes it)."""
        self.engine().start_timeline(file_path, mark_cycles=mark_cycles)

    def stop_timeline(self) -> None:
        self.engine().stop_timeline()

    def mpi_enabled(self) -> bool:
        """Whether this job's communicator runs on MPI (ranks started by mpiexec)."""
        return self.communicator().backend_name == "mpi"

    def mpi_threads_supported(self) -> bool:
        """Ops may come from any thread: the fusion engine alone talks to the backend."""
        self.communicator()
        return True


# Horovod's build queries that do not depend on the framework.

def mpi_built() -> bool:
    return importlib.util.find_spec("mpi4py") is not None


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> bool:
    """Whether CuPy (and with it NCCL) is importable."""
    return importlib.util.find_spec("cupy") is not None


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False
