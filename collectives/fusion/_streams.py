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
import functools
import sys
from typing import Dict, List

from .._gpu import current_stream
from ._device import is_torch as _is_torch

__all__ = ["EngineStreams", "Done", "consume"]


@functools.lru_cache(maxsize=None)  # a hot path: import once (a failure is not cached)
def _cupy():
    from .._gpu import import_cupy_nccl

    return import_cupy_nccl()[0]  # NotSupported with the install hint when CuPy is missing


def _device(x) -> int:
    return x.device.index if _is_torch(x) else int(x.device.id)


def _current_stream(x) -> int:
    """The caller's current stream for x (cudaStream_t as int), in x's framework."""
    return current_stream(x, _device(x), None if _is_torch(x) else _cupy())


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


@contextlib.contextmanager
def _torch_current(ts):
    """`ts` is torch's current stream inside (torch's own context manager, minus its
    Python-level Stream objects, where torch has the raw calls)."""
    import torch

    C = torch._C
    get, put = getattr(C, "_cuda_getCurrentStream", None), getattr(C, "_cuda_setStream", None)
    if get is None or put is None or not hasattr(C, "_cuda_getDevice"):
        with torch.cuda.stream(ts):
            yield
        return
    device, prev = C._cuda_getDevice(), get(ts.device_index)
    put(stream_id=ts.stream_id, device_index=ts.device_index, device_type=ts.device_type)
    try:
        yield
    finally:  # (setting a stream makes its device current: the caller's comes back last)
        put(stream_id=prev[0], device_index=prev[1], device_type=prev[2])
        C._cuda_setDevice(device)


class Done:
    """The done event of one cycle, and the streams already made to wait for it."""

    __slots__ = ("event", "waited")

    def __init__(self, event) -> None:
        self.event, self.waited = event, set()


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
        while the body runs; yields a function that records the done event and returns it
        as a Done."""
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

        def done() -> Done:
            event = cupy.cuda.Event(disable_timing=True)
            cupy.cuda.runtime.eventRecord(event.ptr, s.ptr)
            return Done(event)

        with contextlib.ExitStack() as stack:
            stack.enter_context(cupy.cuda.Device(device))
            if ts is not None:
                stack.enter_context(_torch_current(ts))
            stack.enter_context(s.cupy)
            yield done


def _tensors(result):
    if isinstance(result, (tuple, list)):
        for r in result:
            yield from _tensors(r)
    elif _is_torch(result) or hasattr(result, "__cuda_array_interface__"):
        yield result


def consume(result, done: Done, fresh: bool) -> None:
    """The waiter's current stream waits for the done event before using `result`; a
    `fresh` result (allocated on the engine stream) is marked as used on that stream."""
    wait = None
    for x in _tensors(result):
        if _is_torch(x) and not x.is_cuda:
            continue
        stream = _current_stream(x)
        if stream not in done.waited:
            if wait is None:
                wait = _cupy().cuda.runtime.streamWaitEvent
            wait(stream, done.event.ptr, 0)
            done.waited.add(stream)
        if fresh and _is_torch(x):
            import torch

            x.record_stream(torch.cuda.ExternalStream(stream, device=x.device))
