"""Servers that outlive a flood: descriptors run out, silent connections pile up.

The store and the driver's log server, each in a process with a low descriptor
limit.  An accept() that fails for want of a descriptor (EMFILE) is waited
out, not a reason to stop serving; connections that never finish their
handshake are capped (the excess is closed at once), so a flood of them
cannot lock the ranks out while it lasts or after it ends.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

import _fault_kit as kit

HERE = os.path.dirname(os.path.abspath(__file__))
LIMIT = 256
FLOOD = 600


class ServerProcess:
    def __init__(self, kind: str) -> None:
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "_fd_server.py"), kind,
                                      str(LIMIT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                         sys.path)))
        self.address = self.proc.stdout.readline().strip()
        assert self.address, "the server process did not start"

    def ask(self, cmd: str) -> str:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(params=["store", "log"])
def server(request):
    srv = ServerProcess(request.param)
    yield srv
    srv.close()


def _connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


@pytest.mark.timeout(120)
def test_a_server_out_of_descriptors_serves_again_once_they_are_back(server):
    assert int(server.ask("fill")) > 0
    waiting = [_connect(server.address) for _ in range(5)]  # accept() fails: EMFILE
    time.sleep(0.5)
    assert server.ask("free") == "freed"
    try:
        assert server.ask("works") == "ok"
    finally:
        for s in waiting:
            s.close()


@pytest.mark.timeout(120)
def test_a_flood_of_silent_connections_over_the_descriptor_limit_does_not_lock_clients_out(
        server):
    flood = []
    try:
        for _ in range(FLOOD):
            flood.append(_connect(server.address))
        assert server.ask("works") == "ok"  # while the flood holds its connections
    finally:
        for s in flood:
            s.close()
    assert server.ask("works") == "ok"  # and after it ended
