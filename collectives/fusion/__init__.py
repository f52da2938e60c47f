"""The fusion engine: named async collectives, negotiated across ranks and fused.

    engine = collectives.fusion.FusionEngine(comm, config)
    h = engine.submit("grad.fc1", "allreduce", grad, out=grad, op=ReduceOp.AVERAGE)
    h.wait()

Framework-free: buffers are numpy arrays (torch CPU tensors work too, through
the communicator's buffer mapping), or CUDA tensors and arrays, whose ops run
on the engine's own stream (_streams.py).  See engine.py for the cycle and
scheduling.py for who runs it.
"""
from __future__ import annotations

from .engine import FusionEngine
from .handle import Handle
from .request import KINDS, Signature

__all__ = ["FusionEngine", "Handle", "KINDS", "Signature"]
