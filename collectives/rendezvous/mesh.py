"""Bootstrap: the authenticated TCP links a world's algorithms use, and no others.

Each rank listens on its bind address (the task's address, never every interface) and
publishes its *entry* (plan.py's terms: where it listens, its host, pid, the /dev/shm it
sees, its integrity mode) in one store request.  Rank 0 reads every entry in one request
and publishes the *plan*: the groups (only where a host is split by /dev/shm, or the
launcher gave the ranks no placement), the mode, or the error every rank raises (a rank
that never came, one that returned without init(), ranks that disagree).  Every rank reads
the plan and the entries of its *links* and of its group (one request each), connects to
its linked ranks below it and accepts those above: O(log n) links a leader, none else, and
four requests a rank at the store.  A connection proves the job secret (mutual HMAC)
before its first payload byte, the peer's rank (sent with the handshake channel's tag), is
read; one that fails is dropped and the listener keeps waiting for the real peer, so a
stray or hostile connection never harms the job.  Each connection then has its *link key*
(`auth.Channel.derive`), with which the native transport tags every frame it sends there
(native/src/tcp/mac.h).  Pairs the plan does not link connect the same way when an op
first needs them (`Mesh.connect_all`: alltoall, Adasum).
"""
from __future__ import annotations

import dataclasses
import json
import os
import select
import socket
import struct
import threading
import time
from typing import Dict, Optional, Sequence

from . import auth
from . import plan as plan_mod
from .accept import AcceptGate
from ..backends.base import Topology
from ..errors import AuthenticationError, CollectiveTimeout, PeerLostError, describe
from ..settings import MESH_INTEGRITY
from .store import Store
from ..launch.rankenv import decode_hosts

__all__ = ["Mesh", "build_mesh"]

_LINK_LABEL = b"native mesh frames"


@dataclasses.dataclass
class Mesh:
    topology: Topology
    socks: Dict[int, socket.socket]
    pids: tuple
    addresses: tuple
    rejected: int = 0  # connections dropped for failing the handshake
    keys: Dict[int, bytes] = dataclasses.field(default_factory=dict)  # link key per peer
    integrity: str = "control"  # what the native transport tags (settings.MESH_INTEGRITY)
    #: what `connect_all` needs: (store, prefix, secret, bind address, timeout)
    lazy: Optional[tuple] = None

    def connect_all(self) -> Dict[int, tuple]:
        """Connect this rank to every rank of another group it has no link to, as the
        bootstrap did (every rank calls it at the same op: alltoall's and Adasum's first);
        {rank: (socket, link key, address)} of the new links."""
        store, prefix, secret, bind, timeout = self.lazy
        rank, size = self.topology.rank, self.topology.size
        topo = self.topology
        mine = topo.group_of(rank)  # (within a group, shared memory carries it all)
        missing = [r for r in range(size) if topo.group_of(r) != mine and r not in self.socks]
        listener = socket.create_server((bind, 0), backlog=64)
        try:
            addr, port = listener.getsockname()[:2]
            store.set(f"{prefix}/mesh/all/{rank}", json.dumps({"addr": addr, "port": port}).encode())
            below = [r for r in missing if r < rank]
            entries = dict(zip(below, (json.loads(v) for v in store.get_many(
                [f"{prefix}/mesh/all/{r}" for r in below], timeout))))
            socks, keys, rejected = _link(listener, rank, size, secret, timeout, missing, entries)
        finally:
            listener.close()
        self.socks.update(socks)
        self.keys.update(keys)
        self.rejected += rejected
        return {r: (socks[r], keys[r], "%s:%d" % socks[r].getpeername()[:2]) for r in socks}

    def close(self) -> None:
        for s in self.socks.values():
            try:
                s.close()
            except OSError:
                pass
        self.socks = {}


def _tune(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
        except OSError:
            pass
    sock.settimeout(None)
    return sock


def shm_identity(path: str = "/dev/shm") -> str:
    """Which /dev/shm this process sees: its kernel (boot id) and the mount's device and
    inode.  Ranks of one host whose identities differ (containers with host networking,
    each with its own /dev/shm) cannot meet in a segment; equal ones can."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        st = os.stat(path)
    except OSError:
        return "unknown"
    return f"{boot}:{st.st_dev}:{st.st_ino}"


#: What a rank that waits at init() for one that already returned says (record.py reads it).
RETURNED = "the peer returned from its function and exited without calling init()"


def announce_returned(store, rank: int, prefix: str) -> None:
    """Said by a rank whose function returned without init(): the ranks that wait for its
    address at theirs (under `prefix`, the first communicator's) fail at once, naming it."""
    store.set(f"{prefix}/mesh/rank/{rank}", json.dumps({"returned": True}).encode())


def entry_of(host: str, listener, integrity: str, force_tcp: bool = False,
             hosts: Sequence[str] = ()) -> dict:
    """What a rank publishes about itself (plan.py's entry); `hosts`: the placement its
    launcher gave it (only its digest travels)."""
    addr, port = listener.getsockname()[:2]
    return {"host": host, "addr": addr, "port": port, "pid": os.getpid(), "shm": shm_identity(),
            "integrity": integrity, "tcp": bool(force_tcp), "map": plan_mod.map_digest(hosts)}


def _key(prefix: str, r: int) -> str:
    return f"{prefix}/mesh/rank/{r}"


def _rank0_plan(store, size: int, prefix: str, timeout: float) -> dict:
    """Every entry, then the plan (or the error, as a plan every rank raises)."""
    keys = [_key(prefix, r) for r in range(size)]
    try:
        entries = [json.loads(v) for v in store.get_many(keys, timeout)]
    except CollectiveTimeout:
        missing = next((r for r, k in enumerate(keys) if not store.check(k)), None)
        return {"error": {"kind": "timeout", "what": "rank never published its address",
                          "peer": missing, "hint": "did every rank start and call init()?"}}
    for r, e in enumerate(entries):
        if e.get("returned"):
            return {"error": {"kind": "lost", "what": RETURNED, "peer": r}}
    try:
        return plan_mod.make_plan(entries)
    except plan_mod.PlanError as exc:
        return {"error": {"kind": exc.kind, "what": exc.what, "peer": exc.peer, "hint": exc.hint}}


def _raise_plan_error(err: dict, rank: int, size: int, timeout: float) -> None:
    cls = {"timeout": CollectiveTimeout, "lost": PeerLostError}.get(err["kind"], ValueError)
    raise cls(describe(err["what"], rank=rank, size=size, op="bootstrap", peer=err.get("peer"),
                       timeout=timeout if err["kind"] == "timeout" else None,
                       hint=err.get("hint")))


def exchange(store, rank: int, size: int, me: dict, prefix: str, timeout: float,
             hosts: Sequence[str] = ()) -> tuple:
    """The bootstrap's store phase (see the module docstring): (the plan, every rank's host,
    every rank's group, {rank: entry} of this rank's links and group).  `hosts`: the
    placement this rank's launcher gave it, if any (benchmarks/scale.py runs this for
    simulated ranks too)."""
    store.set(_key(prefix, rank), json.dumps(me).encode())
    if rank == 0:  # it gives up on a late rank sooner than the others give up on it, so its
        # account of that rank reaches them first
        plan = _rank0_plan(store, size, prefix, timeout * 0.8)
        store.set(f"{prefix}/mesh/plan", plan_mod.encode(plan))
    try:
        plan = plan_mod.decode(store.get(f"{prefix}/mesh/plan", timeout))
    except CollectiveTimeout:
        raise CollectiveTimeout(describe(
            "rank 0 never published the mesh's plan", rank=rank, size=size, op="bootstrap",
            peer=0, timeout=timeout, hint="did rank 0 start and call init()?")) from None
    if "error" in plan:
        _raise_plan_error(plan["error"], rank, size, timeout)
    world = decode_hosts(plan["hosts"]) if "hosts" in plan else tuple(hosts)
    groups = plan_mod.groups_of(plan, world)
    wanted = sorted(set(plan_mod.link_peers(rank, groups)) |
                    {r for r in range(size) if groups[r] == groups[rank] and r != rank})
    entries = dict(zip(wanted, (json.loads(v) for v in
                                store.get_many([_key(prefix, r) for r in wanted], timeout))))
    return plan, world, groups, entries


def _accept_peers(listener, rank, size, secret, deadline, socks, errors, stats, keys, want):
    """Accept the ranks of `want` (above this one); each handshake runs in its own thread,
    so a silent or slow stranger never holds up the real peers behind it, and at most
    MAX_PENDING wait at once, as at every other server (`accept.AcceptGate`)."""
    want = set(want)
    lock, done = threading.Lock(), threading.Event()
    gate = AcceptGate()

    def vet(conn):
        try:
            _vet(conn)
        finally:  # the slot is free only once this thread is done with the connection
            gate.release(conn)

    def _vet(conn):
        key = None
        try:
            left = max(min(deadline - time.monotonic(), 10.0), 0.1)
            channel = auth.server_handshake(conn, secret, "mesh", timeout=left)
            said = auth.recv_exact(conn, 4 + auth.MAC, time.monotonic() + left)
            channel.open(said[4:], said[:4])
            peer = struct.unpack(">i", said[:4])[0]
            key = channel.derive(_LINK_LABEL)
        except (AuthenticationError, OSError, ConnectionError):
            peer = None
        with lock:
            if peer not in want:
                stats["rejected"] += 1
                conn.close()
                return
            want.discard(peer)
            socks[peer] = _tune(conn)
            keys[peer] = key
            if not want:
                done.set()
                if wake:  # the accept loop returns now, not at its next timeout
                    os.write(wake[1], b"x")

    if not want:
        return
    wake_r, wake_w = wake = list(os.pipe())
    try:
        while not done.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                with lock:
                    errors.append(CollectiveTimeout(describe(
                        f"ranks {sorted(want)} never connected", rank=rank, size=size,
                        op="bootstrap")))
                return
            ready, _, _ = select.select([listener, wake_r], [], [], min(left, 1.0))
            if listener not in ready:
                continue
            try:
                conn, _ = listener.accept()
            except OSError:  # the listener was closed: bootstrap failed elsewhere
                return
            if gate.admit(conn):  # (else closed: a real peer connects again)
                threading.Thread(target=vet, args=(conn,), daemon=True).start()
    finally:
        with lock:  # a vet thread that finishes later writes nowhere
            wake.clear()
            os.close(wake_r)
            os.close(wake_w)


def _connect_peer(rank, size, peer, info, secret, deadline):
    where = f"{info['addr']}:{info['port']}"
    while True:
        left = max(deadline - time.monotonic(), 0.1)
        sock = None
        try:
            sock = socket.create_connection((info["addr"], info["port"]), timeout=min(5.0, left))
            channel = auth.client_handshake(sock, secret, "mesh", timeout=min(10.0, left))
            said = struct.pack(">i", rank)
            sock.sendall(said + channel.seal(said))
            return _tune(sock), channel.derive(_LINK_LABEL)
        except (OSError, AuthenticationError) as exc:
            if sock is not None:
                sock.close()
            if time.monotonic() > deadline:
                raise PeerLostError(describe(f"cannot connect: {exc}", rank=rank, size=size,
                                             op="bootstrap", peer=peer, address=where)) from exc
            time.sleep(0.05)


def build_mesh(store: Store, rank: int, size: int, host: str, bind_addr: str, secret: bytes,
               prefix: str, timeout: float, force_tcp: bool = False,
               integrity: str = "control", hosts: Sequence[str] = ()) -> Mesh:
    """The links of this rank (see the module docstring); `hosts`: every rank's host, where
    the launcher gave them (RankEnv.hosts)."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside the world of size {size}")
    if integrity not in MESH_INTEGRITY:
        raise ValueError(f"HOROVOD_SPARK_MESH_INTEGRITY must be one of {', '.join(MESH_INTEGRITY)}, "
                         f"got {integrity!r}")
    hosts = tuple(hosts) if len(hosts) == size else ()
    listener = socket.create_server((bind_addr, 0), backlog=64)
    try:
        me = entry_of(host, listener, integrity, force_tcp, hosts)
        plan, world, groups, entries = exchange(store, rank, size, me, prefix, timeout, hosts)
        links = plan_mod.link_peers(rank, groups)
        socks, keys, rejected = _link(listener, rank, size, secret, timeout, links, entries)
    finally:
        listener.close()
    entries[rank] = me
    names = tuple(f"{h}#{r}" if plan.get("tcp") else h for r, h in enumerate(world))
    addresses = tuple(f"{entries[r]['addr']}:{entries[r]['port']}" if r in entries else ""
                      for r in range(size))
    split = plan.get("tcp") or "groups" in plan
    topo = Topology(rank=rank, size=size, hosts=names, addresses=addresses,
                    shm_groups=tuple(groups) if split else ())
    return Mesh(topology=topo, socks=socks, pids=tuple(entries[r]["pid"] if r in entries else 0
                                                       for r in range(size)),
                addresses=addresses, rejected=rejected, keys=keys, integrity=plan["integrity"],
                lazy=(store, prefix, secret, bind_addr, timeout))


def _link(listener, rank: int, size: int, secret: bytes, timeout: float, peers: Sequence[int],
          entries: Dict[int, dict]) -> tuple:
    """Connect to the `peers` below this rank, accept those above: (socks, keys) by rank,
    and how many strangers' connections were dropped."""
    deadline = time.monotonic() + timeout
    socks: Dict[int, socket.socket] = {}
    keys: Dict[int, bytes] = {}
    errors: list = []
    stats = {"rejected": 0}
    above = {p for p in peers if p > rank}
    acceptor = threading.Thread(target=_accept_peers, daemon=True,
                                args=(listener, rank, size, secret, deadline, socks, errors,
                                      stats, keys, above))
    acceptor.start()
    try:
        for peer in (p for p in peers if p < rank):
            socks[peer], keys[peer] = _connect_peer(rank, size, peer, entries[peer], secret,
                                                    deadline)
    finally:
        acceptor.join()
    if errors:
        for s in socks.values():
            s.close()
        raise errors[0]
    return socks, keys, stats["rejected"]
