"""Hostile clients against every server of a job: the rendezvous store (which also carries
the results back to the launcher), the Spark task store, the driver's log server
and a rank's mesh listener.

Each attack must be refused before a byte of payload is parsed, without a crash
(the server serves a real client afterwards), without memory growth, and
without changing the job's result.  Attacks: no secret (a payload sent as if
authenticated), a wrong secret, a replayed handshake, 10,000 random byte
strings, an oversized length header (before and after authentication), and a
crowd of connections that never say a word.
"""
from __future__ import annotations

import os
import socket
import struct
import sys

import pytest

import _fault_kit as kit
import _fault_ranks as ranks
from collectives import _auth
from collectives.errors import AuthenticationError

SECRET = b"\x5a" * 32
FUZZ = 10_000
WARM_UP = 500
RSS_BOUND = 32 << 20  # generous: the figure measured is in benchmarks/RELIABILITY.md


@pytest.fixture(params=["store", "task-store", "log"])
def service(request):
    svc = kit.make_service(request.param, SECRET)
    yield svc
    svc.close()


def _refused(service, before: int, n: int = 1) -> None:
    kit.wait_until(lambda: service.rejected() - before >= n, 10,
                   f"{service.name}: {n} connections counted as rejected")


def test_a_payload_without_the_handshake_never_reaches_the_server(service):
    before = service.rejected()
    answer = kit.attack_without_secret(service.address, service.unauthenticated)
    _refused(service, before)
    assert len(answer) <= len(_auth.MAGIC) + _auth.NONCE, "the server answered past its hello"
    assert not service.planted()
    service.works()


def test_a_wrong_secret_is_refused_and_the_server_keeps_serving(service):
    before = service.rejected()
    assert isinstance(kit.attack_with_wrong_secret(service.address, service.context),
                      AuthenticationError)
    _refused(service, before)
    service.works()


def test_a_replayed_handshake_is_refused(service):
    recorded = kit.recorded_handshake(service.address, SECRET, service.context)
    before = service.rejected()
    answer = kit.attack_replay(service.address, recorded)
    _refused(service, before)
    assert len(answer) == len(_auth.MAGIC) + _auth.NONCE, "the replay got more than a fresh hello"
    service.works()


@pytest.mark.slow
def test_ten_thousand_random_byte_strings_are_each_refused_without_memory_growth(service):
    strings = kit.fuzz_strings(seed=10, n=FUZZ)
    kit.attack_fuzz(service.address, strings[:WARM_UP])  # thread stacks, allocator arenas
    before, rss = service.rejected(), kit.rss()
    answered = kit.attack_fuzz(service.address, strings[WARM_UP:])
    growth = kit.rss() - rss
    _refused(service, before, FUZZ - WARM_UP)
    assert answered == 0, f"{answered} random strings got past the hello"
    assert growth < RSS_BOUND, f"RSS grew {growth >> 20} MiB over {FUZZ - WARM_UP} connections"
    service.works()


def test_an_oversized_length_header_before_authentication_is_refused(service):
    before = service.rejected()
    assert len(kit.attack_without_secret(service.address, kit.oversized_header())) <= 36
    _refused(service, before)
    service.works()


def _authenticated(service) -> socket.socket:
    host, port = service.address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10)
    _auth.client_handshake(s, SECRET, service.context, timeout=5)
    return s


def _hung_up(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionError:
        return True


@pytest.mark.parametrize("header", ["key-length", "value-length"])
def test_an_oversized_length_header_from_an_authenticated_peer_is_dropped(service, header):
    """Even a peer that knows the secret cannot make a server allocate what it claims."""
    rss = kit.rss()
    with _authenticated(service) as s:
        if service.context == "log":
            from horovod_spark._output import send_frame

            send_frame(s, {"t": "hello", "job": "job", "rank": 3})
            s.sendall(struct.pack(">I", 0xFFFFFFFF))
        elif header == "key-length":
            s.sendall(bytes([1]) + struct.pack(">I", 0xFFFFFFFF))
        else:
            s.sendall(bytes([1]) + struct.pack(">I", 1) + b"k" + struct.pack(">Q", 1 << 62))
        assert _hung_up(s), "the server kept a connection that claimed a huge length"
    assert kit.rss() - rss < RSS_BOUND
    service.works()


def test_a_crowd_of_silent_connections_does_not_keep_a_real_client_waiting(service):
    crowd = kit.SilentClients(service.address, 64)
    try:
        service.works()
    finally:
        crowd.close()


# --------------------------------------------------------------------------- a job under attack

def _held_job(fault, size, held, connect_timeout=20.0):
    """start_ranks of held_bootstrap: the bootstrap deadline starts once every rank published."""
    from collectives.launch import start_ranks

    code = f"import _fault_ranks as r; r.held_bootstrap({fault.outdir!r}, {tuple(held)!r})"
    sink = open(os.devnull, "w")
    return start_ranks([sys.executable, "-c", code], size, fault.env(connect_timeout=connect_timeout),
                       stdout=sink, stderr=sink, secret=SECRET)


def _finish(fault, group, size):
    open(os.path.join(fault.outdir, "go"), "w").close()
    kit.wait_until(lambda: all(p.poll() is not None for p in group.procs), 60, "every rank exits")
    return kit.notes(fault.outdir, "result"), [p.returncode for p in group.procs]


@pytest.mark.slow
def test_a_job_whose_store_and_mesh_listener_are_fuzzed_meanwhile_computes_the_same_result(fault):
    group, store = _held_job(fault, 2, held=(1,))
    with group:
        import json

        rank0 = json.loads(kit.wait_until(
            lambda: store.check(f"{group.job}/fault/mesh/rank/0") and
            store.get(f"{group.job}/fault/mesh/rank/0"), 60, "rank 0 publishes"))
        kit.wait_until(lambda: kit.notes(fault.outdir, "listeners").get(1), 60, "rank 1 is held")
        strings = kit.fuzz_strings(seed=3, n=2000)
        before = store.rejected
        answered = kit.attack_fuzz(store.address, strings[:1000])
        answered += kit.attack_fuzz(f"{rank0['addr']}:{rank0['port']}", strings[1000:])
        assert isinstance(kit.attack_with_wrong_secret(f"{rank0['addr']}:{rank0['port']}", "mesh"),
                          AuthenticationError)
        results, codes = _finish(fault, group, 2)
    assert answered == 0
    assert store.rejected - before == 1000
    assert codes == [0, 0] and {r: v["value"] for r, v in results.items()} == {0: 3.0, 1: 3.0}


MESH_SERIAL = ("the mesh listener authenticates one connection at a time with up to 10 s per "
               "handshake, so one silent connection to a rank's port holds bootstrap until "
               "connect_timeout and fails the job (collectives/_mesh.py _accept_peers; fix: run "
               "each accepted connection's handshake in its own thread, collecting the "
               "authenticated peers under a lock)")


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason=MESH_SERIAL)
def test_a_silent_connection_to_a_ranks_listener_does_not_fail_the_job(fault):
    import json

    group, store = _held_job(fault, 2, held=(1,), connect_timeout=5.0)
    with group:
        key = f"{group.job}/fault/mesh/rank/0"
        rank0 = json.loads(kit.wait_until(lambda: store.check(key) and store.get(key), 60,
                                          "rank 0 publishes"))
        kit.wait_until(lambda: kit.notes(fault.outdir, "listeners").get(1), 60, "rank 1 is held")
        crowd = kit.SilentClients(f"{rank0['addr']}:{rank0['port']}", 1)
        try:
            results, codes = _finish(fault, group, 2)
        finally:
            crowd.close()
    assert codes == [0, 0], kit.notes(fault.outdir, "error")


# --------------------------------------------------------------------------- listening addresses

WILDCARDS = ("0.0.0.0", "::", "")


def test_ranks_and_the_launcher_listen_on_the_task_address_only(fault):
    group, store = _held_job(fault, 2, held=(0, 1))
    with group:
        seen = kit.wait_until(lambda: len(kit.notes(fault.outdir, "listeners")) == 2 and
                              kit.notes(fault.outdir, "listeners"), 60, "both ranks held")
        results, codes = _finish(fault, group, 2)
    assert codes == [0, 0]
    assert store.address.startswith("127.0.0.1:")
    for rank, info in seen.items():
        assert info["own"], f"rank {rank} had no listener during bootstrap"
        assert all(ip == info["bind"] for ip, _ in info["own"]), info


@pytest.mark.spark
@pytest.mark.slow
def test_on_spark_ranks_tasks_and_the_driver_listen_on_their_own_address_only(spark, fault):
    import threading

    before = {tuple(a) for a in ranks.listeners(os.getpid())}
    box = {}
    job = threading.Thread(target=lambda: box.setdefault("out", kit.run_spark_job(
        ranks.held_bootstrap, 2, args=(fault.outdir, (0, 1)), env=fault.env(),
        outdir=fault.outdir)), daemon=True)
    job.start()
    try:
        seen = kit.wait_until(lambda: len(kit.notes(fault.outdir, "listeners")) == 2 and
                              kit.notes(fault.outdir, "listeners"), 120, "both ranks held")
        driver = {tuple(a) for a in ranks.listeners(os.getpid())} - before
    finally:
        open(os.path.join(fault.outdir, "go"), "w").close()
        job.join(120)
    out = box["out"]
    assert out.error is None, out.error
    assert [v for v in out.value] == [3.0, 3.0]
    assert driver, "no log server appeared on the driver during the job"
    assert all(ip not in WILDCARDS for ip, _ in driver), driver
    for rank, info in seen.items():
        assert info["bind"] not in WILDCARDS, info
        assert all(ip == info["bind"] for ip, _ in info["own"]), info
        assert all(ip in (info["bind"], "127.0.0.1") for ip, _ in info["parent"]), info
