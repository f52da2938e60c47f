"""The fusion engine: named async collectives, negotiated across ranks and fused.

    engine = collectives.fusion.FusionEngine(comm, config)
    h = engine.submit("grad.fc1", "allreduce", grad, out=grad, op=ReduceOp.AVERAGE)
    h.wait()

Framework-free: buffers are numpy arrays (torch CPU tensors work too, through
the communicator's buffer mapping), or CUDA tensors and arrays, whose ops run
on the engine's own stream.  `FusionEngine` runs the cycle, its `Scheduler`
decides who runs it and when, and its `Lane` runs an armed op's cycle in C++.
"""
from __future__ import annotations

from .engine import FusionEngine
from .handle import Handle
from .request import KINDS, Signature

__all__ = ["FusionEngine", "Handle", "KINDS", "Signature"]
