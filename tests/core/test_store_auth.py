"""The rendezvous store and the handshake, over real sockets."""
import os
import socket
import threading
import time

import pytest

from collectives.rendezvous import auth
from collectives.errors import AuthenticationError, CollectiveTimeout
from collectives.rendezvous.store import TCPStore

SECRET = b"s" * 32


@pytest.fixture
def server():
    srv = TCPStore.serve("127.0.0.1", SECRET)
    yield srv
    srv.close()


def test_set_get_add_delete_round_trip(server):
    c = TCPStore.connect(server.address, SECRET)
    c.set("a", b"\x00\x01payload")
    assert c.get("a") == b"\x00\x01payload"
    assert c.add("n", 2) == 2 and c.add("n", 3) == 5
    assert c.check("a") and not c.check("missing")
    c.delete("a")
    assert not c.check("a")
    c.close()


def test_get_waits_for_a_key_set_later_by_another_client(server):
    a, b = TCPStore.connect(server.address, SECRET), TCPStore.connect(server.address, SECRET)
    threading.Timer(0.2, lambda: b.set("late", b"v")).start()
    assert a.get("late", timeout=10) == b"v"


def test_get_of_a_missing_key_times_out_with_the_key_named(server):
    c = TCPStore.connect(server.address, SECRET)
    with pytest.raises(CollectiveTimeout, match="'nope'"):
        c.get("nope", timeout=0.2)


def test_wrong_secret_is_refused_and_the_store_keeps_serving(server):
    with pytest.raises(AuthenticationError):
        TCPStore.connect(server.address, b"x" * 32, timeout=5)
    good = TCPStore.connect(server.address, SECRET)
    good.set("k", b"v")
    assert good.get("k") == b"v"
    assert server.rejected >= 1


@pytest.mark.parametrize("garbage", [b"", b"GET / HTTP/1.1\r\n\r\n", os.urandom(200), b"HVS1" + b"\0" * 64],
                         ids=["nothing", "http", "random", "zero-mac"])
def test_garbage_handshake_is_dropped_without_harm(server, garbage):
    host, port = server.address.split(":")
    received = b""
    with socket.create_connection((host, int(port))) as s:
        s.settimeout(5)
        try:
            s.sendall(garbage)
            s.shutdown(socket.SHUT_WR)  # a short garbage reply ends; the server must not wait on it
            while chunk := s.recv(100):
                received += chunk
        except (ConnectionResetError, BrokenPipeError, OSError) as exc:
            assert not isinstance(exc, socket.timeout), "the server kept a garbage connection open"
    assert len(received) <= 36  # the server's hello and nothing else: it hung up
    c = TCPStore.connect(server.address, SECRET)
    c.set("still", b"alive")
    assert server.get("still") == b"alive"


def test_replayed_handshake_is_refused():
    a, b = socket.socketpair()
    recorded = {}

    def client():
        hello = auth.recv_exact(b, 36)
        recorded["reply"] = b"HVS1" + os.urandom(32)
        b.sendall(recorded["reply"] + b"\0" * 32)  # not a valid MAC either way

    threading.Thread(target=client).start()
    with pytest.raises(AuthenticationError):
        auth.server_handshake(a, SECRET, "store", timeout=5)


def test_handshake_for_one_service_is_not_accepted_by_another():
    a, b = socket.socketpair()
    errs = []
    t = threading.Thread(target=lambda: errs.append(pytest.raises(AuthenticationError, auth.client_handshake, b, SECRET, "mesh", 5)))
    t.start()
    with pytest.raises(AuthenticationError):
        auth.server_handshake(a, SECRET, "store", timeout=5)
    a.close()
    t.join()


def test_server_binds_only_to_the_given_address(server):
    assert server.address.startswith("127.0.0.1:")
