"""A process of the job's user that took a zygote's name: what the attack on warm starts did.

    python _zygote_impostor.py NAME MODE RECORD

It binds the abstract AF_UNIX name NAME (freed by killing the zygote that held it), prints
"bound", then serves every connection as the zygote's old protocol would let it:

  answer  greets at once ({"ready": [...]}), takes a spawn request's descriptors, reads
          the rank's channel (the job's secret and the pickled function come on it) and
          answers with a forged pid and a clean exit
  garbage answers each packet with 64 random bytes (a guess at a proof)
  relay   connects to NAME's real zygote (argv[4], a second name it still listens on) and
          passes packets both ways, descriptors included
  silent  accepts and never writes a byte

Every packet it receives is appended to RECORD as one JSON line: the bytes (hex), how many
descriptors came with it, and what it read from a channel it was handed.  It exits after
60 s, or when its parent goes.
"""
from __future__ import annotations

import json
import os
import select
import socket
import sys
import time


def record(path: str, **fields) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(fields) + "\n")


def read_channel(fd: int) -> bytes:
    """What a launcher sends on a rank's channel within a second: the secret, the payload."""
    sock = socket.socket(fileno=fd)
    sock.settimeout(1.0)
    got = b""
    try:
        while True:
            chunk = sock.recv(1 << 20)
            if not chunk:
                break
            got += chunk
    except OSError:
        pass
    return got


def serve(conn: socket.socket, mode: str, path: str, relay_name: str) -> bool:
    """One readable packet on `conn`; False once it closed."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 4)
    if not data:
        return False
    stolen = read_channel(fds[2]).hex() if mode == "answer" and len(fds) == 3 else ""
    record(path, data=data.hex(), fds=len(fds), channel=stolen)
    if mode == "garbage":
        conn.send(os.urandom(64))
    elif mode == "answer" and data.startswith(b"{"):
        msg = json.loads(data)
        if "spawn" in msg:
            conn.send(json.dumps({"spawn": msg["spawn"], "pid": os.getpid()}).encode())
            conn.send(json.dumps({"exit": os.getpid(), "status": 0}).encode())
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    return True


def main() -> None:
    name, mode, path = sys.argv[1:4]
    relay_name = sys.argv[4] if len(sys.argv) > 4 else ""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind("\0" + name)
    listener.listen(16)
    print("bound", flush=True)
    conns: dict = {}  # connection -> its relay's upstream (relay mode), else None
    parent, deadline = os.getppid(), time.monotonic() + 60
    while time.monotonic() < deadline and os.getppid() == parent:
        watched = [listener, *conns, *(u for u in conns.values() if u is not None)]
        for sock in select.select(watched, [], [], 0.5)[0]:
            if sock is listener:
                conn, _ = listener.accept()
                upstream = None
                if mode == "relay":
                    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                    upstream.connect("\0" + relay_name)
                conns[conn] = upstream
                if mode == "answer":
                    conn.send(json.dumps({"ready": ["numpy", "pyarrow", "torch"],
                                          "failed": {}}).encode())
            elif sock in conns and mode == "relay":
                data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 4)
                if not data:  # the task hung up
                    conns.pop(sock).close()
                    sock.close()
                    continue
                record(path, data=data.hex(), fds=len(fds), channel="")
                socket.send_fds(conns[sock], [data], fds)
            elif sock in conns:
                if not serve(sock, mode, path, relay_name):
                    conns.pop(sock)
                    sock.close()
            else:  # the real zygote's word, back to the task
                conn = next(c for c, u in conns.items() if u is sock)
                data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 4)
                if data:
                    socket.send_fds(conn, [data], fds)


if __name__ == "__main__":
    main()
