"""Our kernels as asynchronous graph ops, where TensorFlow does not order them.

Inside a tf.function TensorFlow runs stateful ops in program order (its
automatic control dependencies), so every rank runs our collectives in one
order and a blocking kernel (`tf.numpy_function`, the lane op) is safe.  A
graph built outside tf.function (`tf.compat.v1.Graph`, run by a Session) has
no such order: each rank's inter-op threads pick among the ready collectives,
and blocking kernels deadlock once every thread of one rank waits on an op
another rank has not reached.  There every kernel runs as `HvsAsyncKernel`
(async_op.cc, compiled with the lane op): TensorFlow hands the op's inputs to
`_start`, which copies them and returns at once; a *worker* thread of ours runs
the kernel (submit to the fusion engine, wait) and hands the outputs back.  A
worker is started whenever none is idle, so every ready op is submitted and
the engine matches them across ranks by name, in whatever order they come.
"""
from __future__ import annotations

import ctypes
import itertools
import os
import queue
import threading
from typing import Callable, Optional, Sequence

import numpy as np

from . import _lane_op
from ._errors import converted

__all__ = ["call"]

_START_T = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                            ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int),
                            ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int64))
_UNKNOWN = 2  # TensorFlow's error code for an error that is none of its own kinds
_kernels: dict = {}  # kernel id (the op's attr) -> (kernel, output numpy dtypes)
_ids = itertools.count()
_bound: dict = {}  # "pid": the process that bound _start


class _Workers:
    """Threads that run kernels; a new one whenever none is idle, so a kernel never
    waits for another kernel to finish before it starts."""

    def __init__(self) -> None:
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0

    def submit(self, fn: Callable[[], None]) -> None:
        with self._lock:
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1
        self._queue.put(fn)
        if spawn:
            threading.Thread(target=self._loop, name="hvs-tf-kernel", daemon=True).start()

    def _loop(self) -> None:
        while True:
            self._queue.get()()
            with self._lock:
                self._idle += 1


_WORKERS = _Workers()


def call(tf, kernel: Callable, inputs: Sequence, touts: Sequence) -> Optional[list]:
    """kernel(*arrays) -> arrays as an HvsAsyncKernel op; None where the op library is
    unavailable (the caller keeps tf.numpy_function)."""
    lib = _lane_op._library()
    if lib is None:
        return None
    _bind()
    kid = next(_ids)
    _kernels[kid] = (kernel, [np.dtype(d.as_numpy_dtype) for d in touts])
    return list(lib.hvs_async_kernel(list(inputs), Tout=list(touts), kernel=kid))


def _bind() -> None:
    if _bound.get("pid") == os.getpid():
        return
    cdll = _lane_op._state["cdll"]
    cdll.hvs_async_bind.argtypes = [ctypes.c_void_p]
    cdll.hvs_async_bind.restype = None
    cdll.hvs_async_finish.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p),
        ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int),
        ctypes.POINTER(ctypes.c_int64), ctypes.c_int, ctypes.c_char_p]
    cdll.hvs_async_finish.restype = None
    cdll.hvs_async_bind(ctypes.cast(_start, ctypes.c_void_p))
    _bound["pid"] = os.getpid()


_CODES = (1, 2, 3, 4, 5, 6, 9, 10, 14, 17, 19, 22, 23)  # TensorFlow's numeric dtypes and bool
_DTYPES: dict = {}  # TensorFlow dtype code -> numpy dtype
_CODE_OF: dict = {}  # numpy dtype -> TensorFlow dtype code


def _dtype(code: int) -> np.dtype:
    if not _DTYPES:
        import tensorflow as tf

        _DTYPES.update({c: np.dtype(tf.dtypes.as_dtype(c).as_numpy_dtype) for c in _CODES})
        _CODE_OF.update({d: c for c, d in _DTYPES.items()})
    return _DTYPES[code]


def _copy(address: int, shape: tuple, code: int) -> np.ndarray:
    dtype = _dtype(code)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes == 0:
        return np.empty(shape, dtype)
    raw = (ctypes.c_char * nbytes).from_address(address)
    return np.frombuffer(raw, dtype).reshape(shape).copy()  # TensorFlow's buffer stays its own


@_START_T
def _start(kid, handle, n, data, dtypes, ndims, dims):
    """On TensorFlow's thread: copy the inputs, hand the call to a worker, return."""
    try:
        kernel, touts = _kernels[kid]
        arrays, d = [], 0
        for i in range(n):
            shape = tuple(int(dims[d + k]) for k in range(ndims[i]))
            d += ndims[i]
            arrays.append(_copy(data[i], shape, dtypes[i]))
        _WORKERS.submit(lambda: _run(handle, kernel, arrays, touts))
    except BaseException as exc:  # the call still ends, with the error (a C callback must not raise)
        _finish(handle, [], exc)
    return 0


def _run(handle, kernel, arrays: list, touts: list) -> None:
    try:
        with converted():
            outs = kernel(*arrays)
        outs = [np.ascontiguousarray(np.asarray(o, dtype=t)) for o, t in zip(outs, touts)]
    except BaseException as exc:
        return _finish(handle, [], exc)
    _finish(handle, outs, None)


def _finish(handle, outs: list, exc: Optional[BaseException]) -> None:
    """Hand the outputs (or the error) to the op, which is then done (GIL released)."""
    try:
        args = _outputs(outs) if exc is None else _outputs([])
        code, message = 0, b""
    except BaseException as failed:  # the call must end whatever happens
        args, exc = _outputs([]), failed
    if exc is not None:
        import tensorflow as tf

        code = exc.error_code if isinstance(exc, tf.errors.OpError) else _UNKNOWN
        message = f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")
    _lane_op._state["cdll"].hvs_async_finish(handle, *args, code, message)


def _outputs(outs: list) -> tuple:
    """(n, data, dtypes, ndims, dims) as hvs_async_finish takes them."""
    _dtype(_CODES[0])
    n = len(outs)
    data = (ctypes.c_void_p * max(n, 1))(*[o.ctypes.data for o in outs])
    dtypes = (ctypes.c_int * max(n, 1))(*[_CODE_OF[o.dtype] for o in outs])
    ndims = (ctypes.c_int * max(n, 1))(*[o.ndim for o in outs])
    flat = [int(s) for o in outs for s in o.shape]
    dims = (ctypes.c_int64 * max(len(flat), 1))(*flat)
    return n, data, dtypes, ndims, dims
