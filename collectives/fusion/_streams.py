"""CUDA ops of the fusion engine run on the engine's own stream, ordered by events.

A CUDA op is submitted on the caller's thread, after its tensor's *producer*
ran on the caller's current stream (torch's or CuPy's: the framework of the
tensor).  The engine runs the op later, on whichever thread runs the cycle
(its own, or a waiting caller's), on the *engine stream* of the device: a
non-blocking stream of its own, current for torch and CuPy while the cycle's
device ops (packing, NCCL, unpacking) run.  Two events order the three, and
neither blocks the CPU:

- *ready*: recorded on the producer's stream at submission; the engine
  stream waits for it before the op reads the tensor.  Recorded per
  submission (a later record would make an early gradient wait for the rest
  of the backward pass), from a pool: an event is free again once the
  engine stream's wait for it is enqueued.
- *done*: recorded on the engine stream after the cycle's device ops; every
  wait on the handle makes the waiter's then-current stream wait for it, so
  what the caller runs next on that stream sees the result.

Torch's caching allocator is told of every cross-stream use (record_stream):
an input used on the engine stream, a result used on the caller's, so memory
freed on one stream is not handed out while the other may still use it.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Dict, List

__all__ = ["EngineStreams", "consume"]


def _is_torch(x) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _cupy():
    from .._gpu import import_cupy_nccl

    return import_cupy_nccl()[0]  # NotSupported with the install hint when CuPy is missing


def _device(x) -> int:
    return x.device.index if _is_torch(x) else int(x.device.id)


def _current_stream(x) -> int:
    """The caller's current stream for x (cudaStream_t as int), in x's framework."""
    if _is_torch(x):
        import torch

        return int(torch.cuda.current_stream(x.device).cuda_stream)
    return int(_cupy().cuda.get_current_stream(_device(x)).ptr)


class _Stream:
    """The engine stream of one device, as CuPy and (once torch is loaded) torch see it."""

    def __init__(self, cupy, device: int) -> None:
        with cupy.cuda.Device(device):
            self.cupy = cupy.cuda.Stream(non_blocking=True)
        self.ptr, self.device, self._torch = int(self.cupy.ptr), device, None

    @property
    def torch(self):
        if self._torch is None and "torch" in sys.modules:
            import torch

            self._torch = torch.cuda.ExternalStream(self.ptr, device=torch.device("cuda", self.device))
        return self._torch


class EngineStreams:
    """Ready events at submission, the engine stream per device, done events per cycle."""

    def __init__(self) -> None:
        self._streams: Dict[int, _Stream] = {}
        self._free: Dict[int, List[object]] = {}  # device -> recorded-and-waited ready events

    def ready(self, x):
        """Record a ready event on x's producer stream (the caller's current one)."""
        cupy = _cupy()
        device = _device(x)
        free = self._free.setdefault(device, [])
        try:
            event = free.pop()
        except IndexError:
            with cupy.cuda.Device(device):
                event = cupy.cuda.Event(disable_timing=True)
        cupy.cuda.runtime.eventRecord(event.ptr, _current_stream(x))
        return event

    def _stream(self, device: int) -> _Stream:
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = _Stream(_cupy(), device)
        return s

    @contextlib.contextmanager
    def cycle(self, requests: list):
        """Make the engine stream wait for `requests`' producers and be current (torch, CuPy)
        while the body runs; yields a function that records and returns the done event."""
        cupy = _cupy()
        device = _device(requests[0].buf.flat)
        s = self._stream(device)
        wait, free = cupy.cuda.runtime.streamWaitEvent, self._free.setdefault(device, [])
        ts = s.torch
        for req in requests:
            if req.ready is not None:
                wait(s.ptr, req.ready.ptr, 0)
                free.append(req.ready)
                req.ready = None
            if ts is not None:
                for b in (req.buf, req.out):
                    if b is not None and _is_torch(b.flat):
                        b.flat.record_stream(ts)

        def done():
            with cupy.cuda.Device(device):
                event = cupy.cuda.Event(disable_timing=True)
            cupy.cuda.runtime.eventRecord(event.ptr, s.ptr)
            return event

        with contextlib.ExitStack() as stack:
            if ts is not None:
                import torch

                stack.enter_context(torch.cuda.stream(ts))
            stack.enter_context(cupy.cuda.Device(device))
            stack.enter_context(s.cupy)
            yield done


def _tensors(result):
    if isinstance(result, (tuple, list)):
        for r in result:
            yield from _tensors(r)
    elif _is_torch(result) or hasattr(result, "__cuda_array_interface__"):
        yield result


def consume(result, event) -> None:
    """The waiter's current stream waits for `event` before using `result`."""
    cupy = _cupy()
    seen = set()
    for x in _tensors(result):
        if _is_torch(x) and not x.is_cuda:
            continue
        stream = _current_stream(x)
        if stream not in seen:
            seen.add(stream)
            cupy.cuda.runtime.streamWaitEvent(stream, event.ptr, 0)
        if _is_torch(x):
            import torch

            x.record_stream(torch.cuda.current_stream(x.device))
    if not seen:  # a result without a CUDA tensor (a barrier): CuPy's current stream waits
        cupy.cuda.runtime.streamWaitEvent(int(cupy.cuda.get_current_stream().ptr), event.ptr, 0)
