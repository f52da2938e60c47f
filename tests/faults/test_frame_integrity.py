"""Frames after the handshake: an on-path attacker who cannot pass the handshake can
still write into an established stream.  Every store and log frame carries a tag
under the session key, with a sequence number, so an injected, changed or
replayed frame is refused before the server acts on it, and the connection is
dropped.  A real TCP relay between a real client and a real server plays the
attacker.
"""
from __future__ import annotations

import socket
import struct
import threading

import pytest

import _fault_kit as kit
from collectives.errors import CollectiveError
from collectives.rendezvous import auth
from collectives.rendezvous.store import StoreServer, TCPStore

SECRET = b"\x33" * 32
#: A store SET of the job's function key: what a rank unpickles.
SET_FN = bytes([1]) + struct.pack(">I", 6) + b"job/fn" + struct.pack(">Q", 1) + b"x"


class Relay:
    """Forwards one connection to `target` both ways; the attacker's hands on the path."""

    def __init__(self, target: str) -> None:
        self._lst = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self._lst.getsockname()[1]
        self._target = target
        self.upstream = None
        self.sent = bytearray()  # what the client sent, as the attacker saw it
        self._ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        client, _ = self._lst.accept()
        host, port = self._target.rsplit(":", 1)
        self.upstream = socket.create_connection((host, int(port)))
        self._ready.set()
        threading.Thread(target=self._pump, args=(client, self.upstream, True), daemon=True).start()
        self._pump(self.upstream, client, False)

    def _pump(self, src, dst, record: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if record:
                    self.sent += data
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def inject(self, data: bytes) -> None:
        self._ready.wait(10)
        self.upstream.sendall(data)


@pytest.fixture
def server():
    srv = StoreServer("127.0.0.1", 0, SECRET)
    yield srv
    srv.close()


def test_a_frame_injected_after_the_handshake_is_refused_and_the_connection_dropped(server):
    relay = Relay(server.address)
    client = TCPStore.connect(relay.address, SECRET, timeout=10)
    client.set("job/ok", b"1")
    before = server.rejected
    relay.inject(SET_FN + b"\0" * auth.MAC)
    kit.wait_until(lambda: server.rejected > before, 10, "the injected frame is refused")
    assert not server.check("job/fn"), "the injected SET was acted on"
    with pytest.raises(CollectiveError):
        client.get("job/ok", 1)  # the connection the attacker wrote into is gone
    client.close()


def test_a_frame_replayed_on_its_own_connection_is_refused(server):
    relay = Relay(server.address)
    client = TCPStore.connect(relay.address, SECRET, timeout=10)
    mark = len(relay.sent)
    client.set("job/count", b"first")
    frame = bytes(relay.sent[mark:])  # a valid SET with its tag, as seen on the wire
    client.delete("job/count")
    before = server.rejected
    relay.inject(frame)
    kit.wait_until(lambda: server.rejected > before, 10, "the replayed frame is refused")
    assert not server.check("job/count"), "the replayed SET was acted on"
    client.close()


def test_a_log_frame_injected_after_the_handshake_is_not_shown_nor_recorded():
    import io

    from horovod_spark._job.logchannel import LineSink, LogClient, LogServer

    shown = io.StringIO()
    log = LogServer("127.0.0.1", SECRET, "job", LineSink(shown, shown))
    try:
        relay = Relay(log.address)
        client = LogClient(relay.address, SECRET, "job", 2)
        client.line("stdout", "a real line")
        kit.wait_until(lambda: "[2]<stdout>:a real line" in shown.getvalue(), 10, "a line arrives")
        body = b'{"t":"fail","rec":{"rank":2,"planted":true}}'
        relay.inject(struct.pack(">I", len(body)) + body + b"\0" * auth.MAC)
        kit.wait_until(lambda: log.wait_disconnected(0), 10, "the connection is dropped")
        assert not log.failures, log.failures
        client.close()
    finally:
        log.close()
