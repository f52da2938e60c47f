"""The NCCL watchdog: a stuck op or NCCL's asynchronous error aborts instead of hanging."""
from __future__ import annotations

import threading
import time

from collectives.backends._nccl_watchdog import Watchdog
from collectives.errors import CollectiveError, CollectiveTimeout, PeerLostError


class _Event:
    """Stands in for a CUDA event: `done` once the GPU passes it."""

    def __init__(self, done=False):
        self._flag = threading.Event()
        if done:
            self._flag.set()

    @property
    def done(self):
        return self._flag.is_set()

    def finish(self):
        self._flag.set()


def _watchdog(timeout=0.3, async_error=None):
    aborted = threading.Event()

    def check_async():
        if async_error is not None:
            raise async_error

    dog = Watchdog(timeout, check_async, aborted.set,
                   lambda op, seq, tensor, age: CollectiveTimeout(f"{op} #{seq} {tensor} stuck {age:.1f}"),
                   lambda exc: PeerLostError(f"async: {exc}"), poll=0.02)
    return dog, aborted


def _wait_for(cond, limit=5.0):
    deadline = time.monotonic() + limit
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_completed_ops_are_dropped_and_nothing_is_aborted():
    dog, aborted = _watchdog()
    ev = _Event()
    dog.track(ev, "allreduce", 1, "float32[4]")
    ev.finish()
    assert dog.wait_idle(2.0)
    time.sleep(0.5)
    assert dog.error is None and not aborted.is_set()
    dog.close()


def test_an_op_older_than_the_timeout_aborts_the_communicator_and_names_the_op():
    dog, aborted = _watchdog(timeout=0.2)
    dog.track(_Event(), "allgather", 7, "int64[10]")
    assert _wait_for(aborted.is_set)
    assert isinstance(dog.error, CollectiveTimeout)
    assert str(dog.error).startswith("allgather #7 int64[10] stuck")
    assert not dog.wait_idle(0.1) and dog.pending() == 0
    dog.close()


def test_an_asynchronous_nccl_error_aborts_at_once():
    dog, aborted = _watchdog(timeout=60, async_error=RuntimeError("NCCL_ERROR_REMOTE_ERROR: peer gone"))
    dog.track(_Event(), "broadcast", 3, "float16[8]")
    assert _wait_for(aborted.is_set, limit=2.0)
    assert isinstance(dog.error, PeerLostError) and "peer gone" in str(dog.error)
    dog.close()


def test_wait_idle_waits_for_ops_that_finish_later():
    dog, _ = _watchdog(timeout=10)
    ev = _Event()
    dog.track(ev, "barrier", 1, None)
    threading.Timer(0.2, ev.finish).start()
    assert dog.wait_idle(5.0)
    dog.close()


def test_a_cuda_error_on_an_ops_stream_is_recorded_at_once_not_a_timeout_later():
    """An event query that reports a CUDA error (sticky: the events never complete)."""
    aborted = threading.Event()

    def done(event):
        raise CollectiveError("CUDA error 700 (an illegal memory access) on the stream")

    dog = Watchdog(60, lambda: None, aborted.set,
                   lambda op, seq, tensor, age: CollectiveTimeout("stuck"), lambda exc: exc,
                   poll=0.02, done=done)
    dog.track(_Event(), "allreduce", 3, "float32[8]")
    assert _wait_for(aborted.is_set), "the communicator was not aborted"
    assert "CUDA error 700" in str(dog.error) and not isinstance(dog.error, CollectiveTimeout)
    assert dog.wait_idle(1.0) is False
    dog.close()
