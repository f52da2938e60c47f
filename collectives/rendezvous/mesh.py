"""Bootstrap: a full mesh of authenticated TCP connections between ranks.

Each rank listens on its bind address (the task's address, never every
interface), publishes `host:port`, its host identity and pid through the
store in one collective round (with the identity of the /dev/shm it sees, which
splits a host into shared-memory groups), then connects to every lower rank and accepts
every higher one.  A connection proves the job secret (mutual HMAC) before
its first payload byte, the peer's rank (sent with the handshake channel's tag),
is read; one that fails is dropped and the listener keeps waiting for the real
peer, so a stray or hostile connection never harms the job.  Each connection
then has its *link key* (`auth.Channel.derive`), with which the native
transport tags every frame it sends there (native/src/tcp/mac.h); the ranks
agree on how much they tag (`settings.MESH_INTEGRITY`) before any frame moves.
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import struct
import threading
import time
from typing import Dict

from . import auth
from .accept import AcceptGate
from ..backends.base import Topology
from ..errors import AuthenticationError, CollectiveTimeout, PeerLostError, describe
from ..settings import MESH_INTEGRITY
from .store import Store

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


def _shm_groups(peers: list, force_tcp: bool) -> tuple:
    """Per rank: its host, split by what /dev/shm it sees (see shm_identity)."""
    if force_tcp:
        return tuple(f"{p['host']}#{r}" for r, p in enumerate(peers))
    return tuple(f"{p['host']}|{p.get('shm', '')}" for p in peers)


#: What a rank that waits at init() for one that already returned says (record.py reads it).
RETURNED = "the peer returned from its function and exited without calling init()"


def announce_returned(store, rank: int, prefix: str) -> None:
    """Said by a rank whose function returned without init(): the ranks that wait for its
    address at theirs (under `prefix`, the first communicator's) fail at once, naming it."""
    store.set(f"{prefix}/mesh/rank/{rank}", json.dumps({"returned": True}).encode())


def entry_of(host: str, listener, integrity: str) -> dict:
    """What a rank publishes about itself: where it listens, its host, pid, /dev/shm, mode."""
    addr, port = listener.getsockname()[:2]
    return {"host": host, "addr": addr, "port": port, "pid": os.getpid(), "shm": shm_identity(),
            "integrity": integrity}


def _publish(store, rank, size, host, listener, prefix, timeout, integrity):
    return exchange(store, rank, size, entry_of(host, listener, integrity), prefix, timeout)


def exchange(store, rank: int, size: int, me: dict, prefix: str, timeout: float) -> list:
    """The bootstrap's store phase: publish this rank's entry, read every rank's; the
    entries in rank order (benchmarks/scale.py runs it for simulated ranks too)."""
    integrity = me["integrity"]
    store.set(f"{prefix}/mesh/rank/{rank}", json.dumps(me).encode())
    peers = []
    for r in range(size):
        try:
            peers.append(json.loads(store.get(f"{prefix}/mesh/rank/{r}", timeout)))
        except CollectiveTimeout:
            raise CollectiveTimeout(describe(
                "rank never published its address", rank=rank, size=size, op="bootstrap",
                peer=r, timeout=timeout, hint="did every rank start and call init()?")) from None
        if peers[-1].get("returned"):
            raise PeerLostError(describe(RETURNED, rank=rank, size=size, op="bootstrap", peer=r))
    said = {p.get("integrity") for p in peers}
    if len(said) > 1:
        raise ValueError(describe(
            "ranks disagree on HOROVOD_SPARK_MESH_INTEGRITY: " + ", ".join(
                f"rank {r}: {p.get('integrity')}" for r, p in enumerate(peers)),
            rank=rank, size=size, op="bootstrap",
            hint="give every rank the same value (the job's environment)"))
    return peers


def _accept_peers(listener, rank, size, secret, deadline, socks, errors, stats, keys):
    """Accept every higher rank; each handshake runs in its own thread, so a silent
    or slow stranger never holds up the real peers behind it, and at most
    MAX_PENDING wait at once, as at every other server (`accept.AcceptGate`)."""
    want = set(range(rank + 1, size))
    lock, done = threading.Lock(), threading.Event()
    gate = AcceptGate()

    def vet(conn):
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
        finally:
            gate.release(conn)
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

    if not want:
        return
    while not done.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            with lock:
                errors.append(CollectiveTimeout(describe(
                    f"ranks {sorted(want)} never connected", rank=rank, size=size, op="bootstrap")))
            return
        listener.settimeout(min(left, 0.2))
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            continue
        except OSError:  # the listener was closed: bootstrap failed elsewhere
            return
        gate.admit(conn)
        threading.Thread(target=vet, args=(conn,), daemon=True).start()


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
               integrity: str = "control") -> Mesh:
    """Connect every pair of ranks; see the module docstring."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside the world of size {size}")
    if integrity not in MESH_INTEGRITY:
        raise ValueError(f"HOROVOD_SPARK_MESH_INTEGRITY must be one of {', '.join(MESH_INTEGRITY)}, "
                         f"got {integrity!r}")
    listener = socket.create_server((bind_addr, 0), backlog=max(size, 16))
    try:
        peers = _publish(store, rank, size, host, listener, prefix, timeout, integrity)
        deadline = time.monotonic() + timeout
        socks: Dict[int, socket.socket] = {}
        keys: Dict[int, bytes] = {}
        errors: list = []
        stats = {"rejected": 0}
        acceptor = threading.Thread(target=_accept_peers, daemon=True,
                                    args=(listener, rank, size, secret, deadline, socks, errors,
                                          stats, keys))
        acceptor.start()
        for peer in range(rank):
            socks[peer], keys[peer] = _connect_peer(rank, size, peer, peers[peer], secret, deadline)
        acceptor.join()
        if errors:
            for s in socks.values():
                s.close()
            raise errors[0]
    finally:
        listener.close()
    hosts = tuple(f"{p['host']}#{r}" if force_tcp else p["host"] for r, p in enumerate(peers))
    addresses = tuple(f"{p['addr']}:{p['port']}" for p in peers)
    topo = Topology(rank=rank, size=size, hosts=hosts, addresses=addresses,
                    shm_groups=_shm_groups(peers, force_tcp))
    return Mesh(topology=topo, socks=socks, pids=tuple(p["pid"] for p in peers),
                addresses=addresses, rejected=stats["rejected"], keys=keys, integrity=integrity)
