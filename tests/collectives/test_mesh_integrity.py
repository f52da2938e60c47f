"""The native mesh's frame tags (native/src/tcp/mac.h): the tag is HMAC-SHA256; with a
real TCP relay between two native contexts that changes, replays or injects bytes, the
op fails on the rank that reads them, named as an integrity failure of that peer, never
a wrong answer where the bytes are tagged; the job's coordination ops are tagged in the
default mode, every payload in "payload" mode, nothing in "off"; ranks that disagree on
the mode are refused at bootstrap; the op suite passes over TCP with every payload tagged.
"""
import hashlib
import hmac
import os
import socket
import struct
import subprocess
import sys
import threading

import numpy as np
import pytest

from collectives import _native
from collectives.errors import AuthenticationError, CollectiveError
from collectives.launch import run_local
from collectives.rendezvous.mesh import build_mesh
from collectives.rendezvous.store import InMemoryStore
from collectives.types import DType, ReduceOp

HERE = os.path.dirname(os.path.abspath(__file__))
WIRE = 112  # an op header or notice: 96 bytes and its 16-byte tag
F32, SUM = int(DType.FLOAT32), int(ReduceOp.SUM)


def _tags_are_hmac_sha256():
    for n in list(range(0, 200, 7)) + [5000, 1 << 20]:
        key, data = os.urandom(32), os.urandom(n)
        want = hmac.new(key, b"P" + struct.pack(">iiQ", 2, 5, 2**40 + 3) + data,
                        hashlib.sha256).digest()[:16]
        assert _native.mac_tag(key, "P", 2, 5, 2**40 + 3, data) == want, n


def test_the_tag_is_hmac_sha256_of_kind_ranks_counter_and_bytes():
    _tags_are_hmac_sha256()  # the CPU's SHA extensions where it has them
    # and the portable code, in a process of its own (the choice is made at load)
    done = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                           "import test_mesh_integrity as t; t._tags_are_hmac_sha256()", HERE],
                          env=dict(os.environ, HVS_MAC_PORTABLE="1"), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


class Relay:
    """Two socket pairs joined by threads that copy each direction, where `tamper`
    (direction, stream offset, bytes) -> bytes may change what passes; `inject` puts
    bytes into a direction's stream."""

    def __init__(self, tamper=None):
        self.rank0, r0 = socket.socketpair()
        self.rank1, r1 = socket.socketpair()
        self._ends = {0: (r0, r1), 1: (r1, r0)}  # direction d: from rank d to the other
        self._tamper = tamper or (lambda d, off, data: data)
        self._locks = {0: threading.Lock(), 1: threading.Lock()}
        self.passed = {0: bytearray(), 1: bytearray()}
        self._threads = [threading.Thread(target=self._copy, args=(d,), daemon=True)
                         for d in (0, 1)]
        for t in self._threads:
            t.start()

    def _copy(self, d):
        src, dst = self._ends[d]
        off = 0
        while True:
            try:
                data = src.recv(1 << 16)
            except OSError:
                return
            if not data:
                dst.close()
                return
            out = self._tamper(d, off, data)
            off += len(data)
            self.passed[d] += data
            with self._locks[d]:
                try:
                    dst.sendall(out)
                except OSError:
                    return

    def inject(self, d, data):
        with self._locks[d]:
            self._ends[d][1].sendall(data)

    def close(self):
        for s in (self.rank0, self.rank1, *self._ends[0]):
            try:
                s.close()
            except OSError:
                pass


def _contexts(relay, keys=(b"k" * 32, b"k" * 32), payload=False, timeout=2.0):
    ctxs = []
    for rank, sock, key in ((0, relay.rank0, keys[0]), (1, relay.rank1, keys[1])):
        opts = _native.ContextOptions()
        opts.rank, opts.size, opts.hosts, opts.pids = rank, 2, [0, 1], [os.getpid()] * 2
        opts.timeout_s, opts.seal_payload = timeout, payload
        fds = [-1, -1]
        fds[1 - rank] = sock.fileno()
        peer_keys = [b"", b""]
        peer_keys[1 - rank] = key
        ctxs.append(_native.Context(opts, fds, None, ["r0", "r1"], peer_keys))
    return ctxs


def _both(fn0, fn1, timeout=30):
    """fn0 and fn1 on two threads at once; each one's value or exception."""
    out = [None, None]

    def run(i, fn):
        try:
            out[i] = fn()
        except Exception as exc:  # the test reads it
            out[i] = exc

    ts = [threading.Thread(target=run, args=(i, f), daemon=True) for i, f in enumerate((fn0, fn1))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
    assert not any(t.is_alive() for t in ts), "an op hung"
    return out


def _allreduce(ctx, x, control=False):
    def run():
        out = np.empty_like(x)
        ctx.allreduce(x, out, F32, SUM, control=control)
        return out
    return run


def _xs(n=64):
    return np.arange(n, dtype=np.float32), np.ones(n, dtype=np.float32)


@pytest.mark.parametrize("payload", [False, True], ids=["control", "payload"])
def test_tagged_frames_pass_untouched_through_many_ops_and_sizes(payload):
    relay = Relay()
    try:
        c0, c1 = _contexts(relay, payload=payload)
        for n in (0, 1, 1000, 300_000):  # 300k floats: several chunks each way
            for control in (False, True):
                a, b = _xs(n)
                got = _both(_allreduce(c0, a, control), _allreduce(c1, b, control))
                for g in got:
                    np.testing.assert_array_equal(g, a + b)
        for _ in range(50):  # the counters stay in step
            a, b = _xs(8)
            assert all(np.array_equal(g, a + b) for g in _both(_allreduce(c0, a),
                                                               _allreduce(c1, b)))
    finally:
        relay.close()


def _flip(direction, at):
    def tamper(d, off, data):
        if d == direction and off <= at < off + len(data):
            data = bytearray(data)
            data[at - off] ^= 0x01
            return bytes(data)
        return data
    return tamper


def _named_integrity_failure(err, peer):
    assert isinstance(err, AuthenticationError), repr(err)
    assert "failed its integrity check" in str(err) and f"peer rank {peer}" in str(err), str(err)


def test_a_changed_header_bit_fails_the_op_on_the_rank_that_reads_it():
    relay = Relay(_flip(0, 20))  # in rank 0's first header (its op count)
    try:
        c0, c1 = _contexts(relay)
        a, b = _xs()
        got0, got1 = _both(_allreduce(c0, a), _allreduce(c1, b))
        _named_integrity_failure(got1, 0)
        assert "op header" in str(got1)
        # rank 0 is not left waiting: it fails, or (recursive doubling, one exchange, whose
        # data from rank 1 was untouched) returns the right sum
        assert isinstance(got0, CollectiveError) or np.array_equal(got0, a + b), got0
    finally:
        relay.close()


def test_a_changed_payload_bit_is_caught_where_the_payload_is_tagged():
    # control mode: the data of a plain op is not tagged (the documented default) ...
    relay = Relay(_flip(0, WIRE + 7))  # the exponent byte of the second float
    try:
        c0, c1 = _contexts(relay)
        a, b = _xs()
        got0, got1 = _both(_allreduce(c0, a), _allreduce(c1, b))
        assert not np.array_equal(got1, a + b)  # the changed bit went through
    finally:
        relay.close()
    # ... a coordination op's data is; and in payload mode every op's
    for payload, control in ((False, True), (True, False)):
        relay = Relay(_flip(0, WIRE + 7))
        try:
            c0, c1 = _contexts(relay, payload=payload)
            a, b = _xs()
            got0, got1 = _both(_allreduce(c0, a, control), _allreduce(c1, b, control))
            _named_integrity_failure(got1, 0)
            assert "payload" in str(got1)
        finally:
            relay.close()


def test_a_replayed_header_and_a_wrong_key_fail_at_once():
    relay = Relay()
    try:
        c0, c1 = _contexts(relay)
        a, b = _xs()
        _both(_allreduce(c0, a), _allreduce(c1, b))
        first = bytes(relay.passed[0][:WIRE])  # rank 0's first header, tag and all
        relay.inject(0, first)  # played again ahead of the next op's header
        got0, got1 = _both(_allreduce(c0, a), _allreduce(c1, b))
        _named_integrity_failure(got1, 0)
    finally:
        relay.close()
    relay = Relay()
    try:
        c0, c1 = _contexts(relay, keys=(b"k" * 32, b"x" * 32))
        got0, got1 = _both(_allreduce(c0, a), _allreduce(c1, b))
        _named_integrity_failure(got0, 1)
        _named_integrity_failure(got1, 0)
    finally:
        relay.close()


def test_off_tags_nothing_and_ranks_that_disagree_on_the_mode_are_refused():
    relay = Relay()
    try:
        c0, c1 = _contexts(relay, keys=(b"", b""))
        a, b = _xs()
        assert all(np.array_equal(g, a + b) for g in _both(_allreduce(c0, a), _allreduce(c1, b)))
        assert relay.passed[0][WIRE - 16:WIRE] == bytes(16)  # the header's tag left empty
    finally:
        relay.close()
    store, errors = InMemoryStore(), {}

    def rank(r, integrity):
        try:
            build_mesh(store, r, 2, "h", "127.0.0.1", b"s" * 32, "t", 10.0, integrity=integrity)
        except ValueError as exc:
            errors[r] = str(exc)

    ts = [threading.Thread(target=rank, args=(r, m)) for r, m in ((0, "control"), (1, "payload"))]
    [t.start() for t in ts]
    [t.join(20) for t in ts]
    assert set(errors) == {0, 1}
    assert "rank 0: control, rank 1: payload" in errors[0] and "MESH_INTEGRITY" in errors[0]


def _suite(here):
    import sys

    import collectives

    sys.path.insert(0, here)
    from suite import check_all

    comm = collectives.init()
    try:
        return dict(integrity=comm.backend._mesh.integrity, checks=check_all(comm),
                    cross=comm.cross_size)
    finally:
        comm.close()


@pytest.mark.parametrize("hosts", [None, ["a", "a", "b"]], ids=["tcp", "aab"])
def test_every_op_matches_numpy_with_every_payload_tagged(hosts):
    env = {"HOROVOD_SPARK_MESH_INTEGRITY": "payload"}
    if hosts is None:
        env["HOROVOD_SPARK_FORCE_TCP"] = "1"
    results = run_local(_suite, 3, args=(HERE,), env=env, hosts=hosts, timeout=240)
    assert [r["integrity"] for r in results] == ["payload"] * 3
    assert all(r["checks"] > 0 and r["cross"] > 1 for r in results)


def _inject_at(direction, at, extra):
    """Bytes put into a direction's stream at offset `at` (a relay that re-inserts bytes)."""
    def tamper(d, off, data):
        if d == direction and off <= at < off + len(data):
            return data[:at - off] + extra + data[at - off:]
        return data
    return tamper


N = 300_000  # floats: several chunks each way, so changed bytes are reduced and forwarded


@pytest.mark.parametrize("tamper,finder", [
    (_flip(0, WIRE + 7), 1),                 # the first chunk rank 0 sends
    (_flip(1, WIRE + 600_001), 0),           # deep in rank 1's reduce-scatter half
    (_flip(0, 2 * WIRE + N * 2 + 99), 1),    # in what rank 0 forwards in the allgather
    (_inject_at(0, WIRE + 40, b"\x00\x01\x02"), 1),  # re-inserted bytes: the stream shifts
], ids=["first-chunk", "reduce-scatter", "allgather", "injected"])
def test_a_changed_payload_returns_on_no_rank_in_payload_mode(tamper, finder):
    """Payload mode: the rank that reads a changed payload finds it; every rank fails that
    same op (none returns the values the changed bytes reached), each naming who found it."""
    relay = Relay(tamper)
    try:
        c0, c1 = _contexts(relay, payload=True)
        a, b = _xs(N)
        got = _both(_allreduce(c0, a), _allreduce(c1, b))
        for rank, err in enumerate(got):
            assert isinstance(err, AuthenticationError), (rank, repr(err)[:300])
            text = str(err)
            assert "failed its integrity check" in text, text
            if rank == finder:  # it names the peer whose bytes changed
                assert f"peer rank {1 - finder}" in text, text
            else:  # it names the rank that found them
                assert f"rank {finder}" in text and "peer rank" in text, text
        assert any("no rank returns this op's result" in str(e) or "this rank stops" in str(e)
                   for e in got)
        for ctx in (c0, c1):  # and the communicator stops there, on both
            with pytest.raises(CollectiveError):
                _allreduce(ctx, a[:8])()
    finally:
        relay.close()


def test_payload_mode_confirms_every_op_and_stays_in_step():
    """The confirmation round of every op in payload mode: many ops of every size pass, and
    each op moves one more small exchange than in control mode."""
    counts = {}
    for payload in (False, True):
        relay = Relay()
        try:
            c0, c1 = _contexts(relay, payload=payload)
            for n in (0, 1, 5, 1000, 70_000):
                a, b = _xs(n)
                assert all(np.array_equal(g, a + b)
                           for g in _both(_allreduce(c0, a), _allreduce(c1, b)))
            counts[payload] = c0.stats["tcp_ops"]
        finally:
            relay.close()
    assert counts[True] == 2 * counts[False] > 0
