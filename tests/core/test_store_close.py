"""Closing a StoreServer ends its threads and fails its clients clearly, over real sockets."""
import re
import socket
import threading
import time

import pytest

from collectives.errors import CollectiveError
from collectives.rendezvous.store import InMemoryStore, TCPStore

SECRET = b"c" * 32


def _threads_of(server):
    return [t for t in threading.enumerate() if t.name.endswith(server.address) and t.is_alive()]


def _wait_until(check, timeout, what):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.02)


def test_close_ends_every_store_thread_and_clients_get_an_error_naming_the_address():
    server = TCPStore.serve("127.0.0.1", SECRET)
    client, waiter = TCPStore.connect(server.address, SECRET), TCPStore.connect(server.address, SECRET)
    client.set("k", b"v")
    host, port = server.address.rsplit(":", 1)
    raw = socket.create_connection((host, int(port)))  # never authenticates
    waited = []
    blocked = threading.Thread(target=lambda: waited.append(pytest.raises(CollectiveError, waiter.get, "never")))
    blocked.start()
    # accept, two authenticated connections and one stuck in the handshake
    _wait_until(lambda: len(_threads_of(server)) == 4, 10, "the server serves all three connections")

    server.close()

    _wait_until(lambda: not _threads_of(server), 5, f"store threads still alive: {_threads_of(server)}")
    with pytest.raises(CollectiveError, match=re.escape(server.address)):
        client.get("k", timeout=5)
    blocked.join(10)
    assert not blocked.is_alive(), "a client waiting on a key was not woken by close()"
    assert re.search(re.escape(server.address), str(waited[0].value))
    raw.settimeout(5)
    assert len(raw.recv(100)) <= 36 and raw.recv(100) == b""  # the hello at most, then EOF
    assert server.rejected == 0  # a handshake cut short by close() is not counted as an attack
    for s in (client, waiter, raw):
        s.close()


def test_connecting_to_a_closed_store_names_its_address():
    server = TCPStore.serve("127.0.0.1", SECRET)
    server.close()
    with pytest.raises(CollectiveError, match=re.escape(f"cannot reach the rendezvous store at {server.address}")):
        TCPStore.connect(server.address, SECRET, timeout=0.5)


def test_closing_an_in_memory_store_wakes_a_waiting_get():
    store, errors = InMemoryStore(), []
    waiter = threading.Thread(target=lambda: errors.append(pytest.raises(CollectiveError, store.get, "k")))
    waiter.start()
    time.sleep(0.05)
    store.close()
    waiter.join(5)
    assert not waiter.is_alive() and "closed while waiting for key 'k'" in str(errors[0].value)
