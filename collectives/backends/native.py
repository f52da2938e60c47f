"""The native CPU backend: shared memory within a host, TCP across hosts.

A thin layer over `collectives._native` (C++, native/): this file only wires
the mesh, the store and the config into a native Context and maps the
Backend methods onto it.  The GIL is released inside every native call.

Shared memory joins the ranks of a *group*: those of one host that see one
/dev/shm (the mesh tells them apart; containers with host networking make
several groups on one address, and TCP joins them).  The group's first rank
("local rank 0" below) publishes a fresh random name through the store, then
creates the segment; the other local ranks attach (retrying until it exists); the name is unlinked as soon as all are attached (by the last to
attach, and by the creator or a failing attacher in any case), so a crash at
any point of bootstrap never leaves a segment in /dev/shm that nobody knows.
A rank waiting on local rank 0 checks its pid, so a death there is named.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Optional, Sequence

from .. import _native
from ..errors import CollectiveError, CollectiveTimeout, PeerLostError, describe
from ..types import DType, ReduceOp
from ._topology_log import describe_topology, log
from .base import Backend
from .shm_names import segment_name

__all__ = ["NativeBackend", "TUNING", "usable_cores", "host_cores"]

#: Chunk sizes of the native algorithms (bytes); benchmarks may override them.
TUNING = {
    "shm_chunk": 256 * 1024,    # one shared-memory step: fits L2 with the data it touches
    "small_bytes": 64 * 1024,   # allreduce up to here in one step, every rank reducing all
    "cma_bytes": 4 * 1024 * 1024,  # allreduce from here up by cross-memory attach (0: never)
    "cma_chunk": 2 * 1024 * 1024,  # its pipelined chunks
    "tcp_chunk": 512 * 1024,    # one ring item (and the staging buffer of a reduce)
    # across hosts from twice this up: the leaders' ring one chunk at a time, overlapped
    # with the shared-memory phases of the chunks around it (0: never)
    "hier_chunk": 2 * 1024 * 1024,
    # across hosts up to here by recursive doubling, not the ring (0: never); every rank alike
    "doubling_bytes": 4096,
    "spin_us": 50,              # spin before yielding, when every local rank has a core
    "yield_us": 200,            # then yield the core before sleeping
    # when local ranks outnumber cores: barely spin, sleep at once, and sync less often
    "crowded_spin_us": 2,
    "crowded_yield_us": 0,
    "crowded_shm_chunk": 1024 * 1024,
}


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def host_cores(topology, pids) -> int:
    """The cores this host's ranks may run on together: the union of their affinity masks,
    so ranks pinned to a core each (taskset, `mpiexec --bind-to core`) count every core,
    not one.  Where a peer's mask cannot be read (another pid namespace), this rank's own
    mask stands for all of them."""
    try:
        cores = set(os.sched_getaffinity(0))
        for r in topology.shm_ranks:
            if r != topology.rank:
                cores |= os.sched_getaffinity(int(pids[r]))
    except (AttributeError, OSError, ValueError, IndexError):
        return usable_cores()
    return len(cores)


def _say_failed(store, key: str, exc: BaseException) -> None:
    """Local rank 0's account of a failed shared-memory bootstrap, for its local ranks."""
    import json

    what = str(exc).split(": ", 1)[-1]
    peer = getattr(exc, "peer", None)
    if peer is None:
        import re

        m = re.search(r"peer rank (\d+)", what)
        peer = int(m.group(1)) if m else None
    try:
        store.set(f"{key}/failed", json.dumps({"what": what.split(" (peer rank")[0],
                                               "peer": peer}).encode())
    except Exception:  # noqa: BLE001 - the store may be gone too; they then name rank 0
        pass


def _failed(store, key: str):
    import json

    try:
        return json.loads(store.get(f"{key}/failed", 0.0)) if store.check(f"{key}/failed") \
            else None
    except Exception:  # noqa: BLE001
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class NativeBackend(Backend):
    name = "native"

    def __init__(self, mesh, store, config, prefix: str) -> None:
        super().__init__(mesh.topology)
        self._ctx = None
        self._mesh = mesh
        self._config = config
        self._all_linked = mesh.lazy is None
        self._link_lock = threading.Lock()
        tune = dict(TUNING)
        topo = mesh.topology
        order = topo.shm_order  # the native "hosts": groups that share one /dev/shm
        opts = _native.ContextOptions()
        opts.rank, opts.size = topo.rank, topo.size
        at = {g: i for i, g in enumerate(order)}
        opts.hosts = [at[topo.group_of(r)] for r in range(topo.size)]
        opts.pids = [int(p) for p in mesh.pids]
        opts.timeout_s = float(config.timeout)
        crowded = "crowded_" if len(topo.shm_ranks) > host_cores(topo, mesh.pids) else ""
        opts.spin_ns = int(tune[crowded + "spin_us"] * 1000)
        opts.yield_ns = int(tune[crowded + "yield_us"] * 1000)
        opts.shm_chunk = int(tune[crowded + "shm_chunk"] if crowded else tune["shm_chunk"])
        opts.small_bytes = int(tune["small_bytes"])
        opts.cma_bytes = int(tune["cma_bytes"])
        opts.cma_chunk = int(tune["cma_chunk"])
        opts.cma = bool(config.shm_cma)
        opts.tcp_chunk = int(tune["tcp_chunk"])
        opts.hier_chunk = int(tune["hier_chunk"])
        opts.doubling_bytes = int(tune["doubling_bytes"])
        opts.seal_payload = mesh.integrity == "payload"
        fds = [-1] * topo.size
        for peer, sock in mesh.socks.items():
            sock.setblocking(False)
            fds[peer] = sock.fileno()
        keys = [b""] * topo.size
        if mesh.integrity != "off":
            for peer, key in mesh.keys.items():
                keys[peer] = key
        try:
            segment = self._shared_memory(store, prefix)
            self._ctx = _native.Context(opts, fds, segment, list(mesh.addresses), keys)
        except BaseException:
            self.close()  # the mesh is ours now: no socket outlives a failed bootstrap
            raise
        if log.isEnabledFor(10):  # logging.DEBUG
            log.debug(describe_topology(topo, tune, bool(config.shm_cma)))

    def _shared_memory(self, store, prefix: str):
        topo, config = self.topology, self._config
        local = topo.shm_ranks
        if len(local) == 1:
            return None
        key = f"{prefix}/native/shm/{local[0]}"
        if topo.rank != local[0]:
            return self._attach(self._wait_for_name(store, key, local[0]), local, store, key)
        # Publish first, then create: a death in between leaves nothing behind.
        name = segment_name(os.getpid())  # the parent removes it if this process is killed
        store.set(key, name.encode())
        seg = _native.ShmSegment.create(name, len(local), config.shm_slot_bytes, topo.rank)
        try:
            self._wait_attached(seg, local)
        except CollectiveError as exc:  # the local ranks still waiting learn who, not only
            _say_failed(store, key, exc)  # that local rank 0 is gone
            raise
        finally:
            seg.unlink()
        return seg

    def _wait_for_name(self, store, key: str, leader: int) -> str:
        """The segment name local rank 0 publishes; named errors if it never does."""
        timeout = self._config.connect_timeout
        deadline = time.monotonic() + timeout
        while True:
            try:
                return store.get(key, min(0.25, max(deadline - time.monotonic(), 0.01))).decode()
            except CollectiveTimeout:
                pass
            self._check_alive(leader, "died before publishing its shared memory", store, key)
            if time.monotonic() > deadline:
                raise CollectiveTimeout(self._msg(
                    "local rank 0 never published its shared memory", "bootstrap", peer=leader,
                    timeout=timeout, hint="is that process alive?"))

    def _attach(self, name: str, local: Sequence[int], store, key: str):
        """Attach, retrying while local rank 0 has not created the segment yet."""
        topo, config = self.topology, self._config
        deadline = time.monotonic() + config.connect_timeout
        try:
            while True:
                seg = _native.ShmSegment.attach(name, len(local), config.shm_slot_bytes, topo.rank)
                if seg is not None:
                    return seg
                self._check_alive(local[0], "died before creating its shared memory", store, key)
                if time.monotonic() > deadline:
                    raise CollectiveTimeout(self._msg(
                        f"shared memory {name} never appeared", "bootstrap", peer=local[0],
                        timeout=config.connect_timeout))
                time.sleep(0.001)
        except BaseException:
            _native.ShmSegment.unlink_name(name)  # nobody else might
            raise

    def _check_alive(self, peer: int, what: str, store=None, key: str = "") -> None:
        if _alive(self._mesh.pids[peer]):
            return
        said = _failed(store, key) if store is not None else None
        if said is not None:  # local rank 0 failed first, on account of another rank
            raise PeerLostError(self._msg(f"local rank 0 failed: {said['what']}", "bootstrap",
                                          peer=said.get("peer")))
        raise PeerLostError(self._msg(f"local rank {self.topology.shm_ranks.index(peer)} {what}",
                                      "bootstrap", peer=peer))

    def _wait_attached(self, seg, local: Sequence[int]) -> None:
        deadline = time.monotonic() + self._config.connect_timeout
        while seg.attached < len(local):
            for r in local:
                if r != self.rank:
                    self._check_alive(r, "died before attaching to shared memory")
            if time.monotonic() > deadline:
                raise CollectiveTimeout(self._msg(
                    f"only {seg.attached} of {len(local)} local ranks attached to shared memory",
                    "bootstrap", timeout=self._config.connect_timeout))
            time.sleep(0.001)

    def _msg(self, what: str, op: str, **kw) -> str:
        peer = kw.get("peer")
        return describe(what, rank=self.rank, size=self.size, op=op,
                        address=self._mesh.addresses[peer] if peer is not None else None, **kw)

    @property
    def cma(self) -> str:
        """Cross-memory attach in large shm allreduces: 'on' or 'off' once the ranks of
        this host agreed (their first large allreduce), 'unknown' before, 'none' alone."""
        return self._native().cma

    @property
    def native_context(self):
        """The native context (`_native.Context`), for a fusion lane over it; None once closed."""
        return self._ctx

    def transport_metrics(self) -> dict:
        """What this rank moved since bootstrap: tcp_ops (ops that sent or received over
        TCP), tcp_bytes_sent, tcp_bytes_received (payload), shm_ops and shm_bytes (ops
        through this host's shared segment and their payload), pipelined_ops (allreduces
        across hosts whose shared-memory phases overlapped the leaders' ring)."""
        return dict(self._native().stats) if self._ctx is not None else {}

    def _native(self):
        if self._ctx is None:
            raise PeerLostError(self._msg("the native backend is closed", "collective"))
        return self._ctx

    # -- collectives -------------------------------------------------------
    # Errors carry what went wrong, the peer, its address and the timeout; the
    # Communicator puts the op, its sequence number, the tensor and this rank
    # in front.
    def allreduce(self, src, dst, dtype: DType, op: ReduceOp) -> None:
        ctx = self._ctx  # the hot path: no extra call (DType and ReduceOp are ints)
        if ctx is None:
            self._native()
        ctx.allreduce(src, dst, dtype, op)

    def allgather(self, src, dst, dtype: DType, counts: Sequence[int]) -> None:
        self._native().allgather(src, dst, int(dtype), [int(c) for c in counts])

    def control_allreduce(self, src, dst, dtype: DType, op: ReduceOp) -> None:
        self._native().allreduce(src, dst, int(dtype), int(op), control=True)

    def control_allgather(self, src, dst, dtype: DType, counts: Sequence[int]) -> None:
        self._native().allgather(src, dst, int(dtype), [int(c) for c in counts], control=True)

    def broadcast(self, buf, dtype: DType, root: int) -> None:
        self._native().broadcast(buf, int(dtype), int(root))

    def reducescatter(self, src, dst, dtype: DType, op: ReduceOp, counts: Sequence[int]) -> None:
        self._native().reducescatter(src, dst, int(dtype), int(op), [int(c) for c in counts])

    def alltoall(self, src, send_counts: Sequence[int], dst, recv_counts: Sequence[int],
                 dtype: DType) -> None:
        self._every_pair().alltoall(src, [int(c) for c in send_counts], dst,
                                    [int(c) for c in recv_counts], int(dtype))

    def adasum(self, buf, dtype: DType, segments: Sequence[int]) -> None:
        self._every_pair().adasum(buf, int(dtype), [int(n) for n in segments])

    def _every_pair(self):
        """The native context, linked to every rank of another group: alltoall (and Adasum,
        whose exchanges are alltoalls) talk to every pair, which the bootstrap leaves
        unlinked (rendezvous/plan.py); every rank comes here at the same op."""
        ctx = self._native()
        if not self._all_linked:
            with self._link_lock:
                if not self._all_linked:
                    for peer, (sock, key, address) in self._mesh.connect_all().items():
                        sock.setblocking(False)
                        ctx.add_link(peer, sock.fileno(),
                                     key if self._mesh.integrity != "off" else b"", address)
                    self._all_linked = True
        return ctx

    def barrier(self) -> None:
        self._native().barrier()

    def close(self) -> None:
        self._ctx = None
        if self._mesh is not None:
            self._mesh.close()
            self._mesh = None
