"""One error hierarchy for every backend and for the fusion engine.

Every message names what a reader needs to act: this rank and the world size,
the op and its sequence number, the tensor, the peer and its address, the
timeout, and a hint where the fix is known.  Build messages with `describe`.
"""
from __future__ import annotations

from typing import Optional

__all__ = [
    "CollectiveError",
    "PeerLostError",
    "CollectiveTimeout",
    "MismatchError",
    "NotSupported",
    "AuthenticationError",
    "describe",
]


class CollectiveError(RuntimeError):
    """Base class of every communication failure."""


class PeerLostError(CollectiveError):
    """A peer closed its connection, died, or its process is gone."""


class CollectiveTimeout(CollectiveError):
    """No progress from a peer within the configured timeout."""


class MismatchError(CollectiveError):
    """Ranks disagree on a collective: name, shape, dtype, op or root."""


class NotSupported(CollectiveError):
    """The backend does not implement this op or dtype."""


class AuthenticationError(CollectiveError):
    """A connection did not prove knowledge of the job secret."""


def describe(
    what: str,
    *,
    rank: Optional[int] = None,
    size: Optional[int] = None,
    op: Optional[str] = None,
    seq: Optional[int] = None,
    tensor: Optional[str] = None,
    peer: Optional[int] = None,
    address: Optional[str] = None,
    timeout: Optional[float] = None,
    hint: Optional[str] = None,
) -> str:
    """Format a message in the project's one style, e.g.

    ``allreduce #17 'grad.fc1' float32[4096] on rank 2/8: no data from rank 3
    (host-b:41000) for 30 s; is that process alive?``
    """
    head = []
    if op:
        head.append(op if seq is None else f"{op} #{seq}")
    if tensor:
        head.append(tensor)
    if rank is not None:
        head.append(f"on rank {rank}/{size}" if size is not None else f"on rank {rank}")
    msg = " ".join(head)
    body = what
    if peer is not None:
        body += f" (peer rank {peer}" + (f" at {address}" if address else "") + ")"
    elif address:
        body += f" ({address})"
    if timeout is not None:
        body += f" after {timeout:g} s"
    out = f"{msg}: {body}" if msg else body
    if hint:
        out += f"; {hint}"
    return out
