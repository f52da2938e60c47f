"""A hostile host: connects to every listener it is told of and misbehaves.

Run in a box of its own.  stdin: one `address port` a line.  For each, in a
thread: an idle connection and a half handshake (the protocol's first 4
bytes), both held open until EOF on stdin; 4 KiB of random bytes; a
handshake with a wrong secret.  On EOF it drops what it holds and prints
`REPORT {json}`: per listener, whether it spoke our handshake ("ours"), what
it did with the garbage ("closed" or "open" after 12 s) and with the wrong
secret ("closed", "silent", or "answered": it went on talking, a defect).
"""
import json
import os
import socket
import sys
import threading

MAGIC = b"HVS1"
HELLO = len(MAGIC) + 32
held, report, lock = [], {}, threading.Lock()


def _recv_exact(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _after(sock, discard: bool) -> str:
    """What the server does next: closes, stays silent, or talks (answered)."""
    sock.settimeout(12)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return "closed"
            if not discard:
                return "answered"
    except socket.timeout:
        return "open" if discard else "silent"
    except OSError:
        return "closed"
    finally:
        sock.close()


def _connect(addr, port):
    return socket.create_connection((addr, port), timeout=5)


def attack(addr: str, port: int) -> None:
    out = {}
    try:
        idle, half = _connect(addr, port), _connect(addr, port)
        with lock:
            held.extend([idle, half])
        half.sendall(MAGIC)
        g = _connect(addr, port)
        g.sendall(os.urandom(4096))
        out["garbage"] = _after(g, discard=True)
        w = _connect(addr, port)
        hello = _recv_exact(w, HELLO)
        out["ours"] = hello[:4] == MAGIC
        if out["ours"]:
            w.sendall(MAGIC + os.urandom(64))  # a client nonce and a MAC made without the secret
        out["wrong_secret"] = _after(w, discard=False)
    except OSError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    with lock:
        report[f"{addr}:{port}"] = out


def main() -> None:
    threads = []
    for line in sys.stdin:
        addr, port = line.split()
        t = threading.Thread(target=attack, args=(addr, int(port)), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join(timeout=30)
    with lock:
        for s in held:
            s.close()
        print("REPORT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
