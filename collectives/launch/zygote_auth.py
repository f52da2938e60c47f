"""The proof on a zygote's named connection: both ends show they hold the session's token.

Terms.  The *token* is 32 random bytes the zygote's owners share and no rank holds (the package's
driver makes one per session and sends it in its task specs, never in an environment);
an owner that starts a zygote hands it the token on the private socketpair it starts it
with.  A *named connection* is one made
to the zygote's abstract AF_UNIX name, which any process of the same user can read in
/proc/net/unix and, once the zygote is gone, bind: the kernel's peer credentials say
only that the peer has the same uid.  So before a byte or a descriptor of a job passes,
the two ends run a challenge-response (one SOCK_SEQPACKET packet each, fixed sizes,
nothing parsed beyond a length and a compare):

    task   -> zygote   HELLO | task nonce (32)
    zygote -> task     zygote nonce (32) | HMAC(token, "z" | tn | zn | pids)
    task   -> zygote   HMAC(token, "t" | zn | tn | pids)

where *pids* are the zygote's and the task's process ids, each end taking its own from
the kernel and its peer's from SO_PEERCRED.  The token itself never crosses the
connection, the nonces are fresh each time (a recorded proof cannot be replayed), the
two roles' tags differ (one cannot be reflected as the other), and a process that holds
the name and relays a task's proof to a real zygote it connected to sees it fail: the
task's peer is the relay, not the zygote whose pid the tag holds.  A holder of the name
that cannot answer, or does not answer within PROOF_TIMEOUT_S, is not the session's
zygote: the task starts its rank fresh.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time
from typing import Optional

__all__ = ["TOKEN_BYTES", "PROOF_TIMEOUT_S", "ZygoteUntrusted", "prove_to_zygote", "Proof",
           "token_digest"]

TOKEN_BYTES = 32
NONCE = 32
MAC = 32
HELLO = b"HVZ1"
#: Seconds a task waits for a zygote's half of the proof (the zygote answers from its loop,
#: or from a thread while it imports, so a real one answers in milliseconds).
PROOF_TIMEOUT_S = 5.0


class ZygoteUntrusted(Exception):
    """The holder of the zygote's name failed the proof or went silent: nothing was handed
    to it, and the task starts its rank the ordinary way."""


def _mac(token, role: bytes, a: bytes, b: bytes, zygote: int, task: int) -> bytes:
    pids = f"|{zygote}|{task}".encode()
    return hmac.new(token, b"hvs-zygote|" + role + a + b + pids, hashlib.sha256).digest()


def peer_pid(sock: socket.socket) -> int:
    """The pid of the process at the other end of an AF_UNIX connection, from the kernel."""
    return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                               struct.calcsize("3i")))[0]


def token_digest(token) -> str:
    """A public name for a token (a part of the zygote's address): it reveals nothing of it."""
    return hashlib.sha256(b"hvs-zygote-name|" + bytes(token)).hexdigest()[:16]


def _who(sock: socket.socket) -> str:
    try:
        pid = peer_pid(sock)
    except OSError:
        return "a process"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()[:120]
    except OSError:
        cmd = "?"
    return f"process {pid} ({cmd})"


def prove_to_zygote(sock: socket.socket, token, timeout: float = PROOF_TIMEOUT_S) -> None:
    """The task's side, on a freshly connected named connection; ZygoteUntrusted naming the
    process that holds the name where it is not the session's zygote."""
    tn = os.urandom(NONCE)
    old = sock.gettimeout()
    try:
        sock.settimeout(timeout)
        sock.send(HELLO + tn)
        reply = sock.recv(NONCE + MAC + 1)
    except socket.timeout:
        raise ZygoteUntrusted(f"the zygote's name is held by {_who(sock)}, which gave no proof "
                              f"in {timeout:g} s that it belongs to this session") from None
    except OSError as exc:
        raise ZygoteUntrusted(f"the zygote's connection broke during its proof "
                              f"({type(exc).__name__}: {exc})") from None
    finally:
        try:
            sock.settimeout(old)
        except OSError:
            pass
    zn, pids = reply[:NONCE], (peer_pid(sock), os.getpid())
    if len(reply) != NONCE + MAC or not hmac.compare_digest(reply[NONCE:],
                                                            _mac(token, b"z", tn, zn, *pids)):
        raise ZygoteUntrusted(f"the zygote's name is held by {_who(sock)}, which failed the "
                              f"proof that it belongs to this session (it does not hold the "
                              f"session's token)")
    try:
        sock.send(_mac(token, b"t", zn, tn, *pids))
    except OSError as exc:
        raise ZygoteUntrusted(f"the zygote's connection broke during its proof "
                              f"({type(exc).__name__}: {exc})") from None


class Proof:
    """The zygote's side of one named connection, driven by its select loop: `step` on each
    packet; True once the task has proved itself, False while it is due, ValueError on a
    failure (the connection is then closed unread)."""

    def __init__(self, token, timeout: float = PROOF_TIMEOUT_S) -> None:
        self._token = token
        self.deadline = time.monotonic() + timeout
        self._expect: Optional[bytes] = None  # the task's tag, once the zygote has answered

    def step(self, sock: socket.socket) -> bool:
        packet = sock.recv(len(HELLO) + NONCE + 1)
        if self._expect is None:
            if len(packet) != len(HELLO) + NONCE or packet[:len(HELLO)] != HELLO:
                raise ValueError("not a zygote hello")
            tn, zn = packet[len(HELLO):], os.urandom(NONCE)
            pids = os.getpid(), peer_pid(sock)
            self._expect = _mac(self._token, b"t", zn, tn, *pids)
            sock.send(zn + _mac(self._token, b"z", tn, zn, *pids))
            return False
        if len(packet) != MAC or not hmac.compare_digest(packet, self._expect):
            raise ValueError("the peer does not hold the session's token")
        return True
