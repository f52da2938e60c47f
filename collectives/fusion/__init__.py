"""The fusion engine: named async collectives, negotiated across ranks and fused.

    engine = collectives.fusion.FusionEngine(comm, config)
    h = engine.submit("grad.fc1", "allreduce", grad, out=grad, op=ReduceOp.AVERAGE)
    h.wait()

Framework-free: buffers are numpy arrays (torch CPU tensors work too, through
the communicator's buffer mapping).  See engine.py for the cycle.
"""
from __future__ import annotations

from .engine import FusionEngine
from .handle import Handle
from .request import KINDS, Signature

__all__ = ["FusionEngine", "Handle", "KINDS", "Signature"]
