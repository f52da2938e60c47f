"""The native allreduce op: `HvsLaneAllreduce` (its C++ beside this module), the steady-state path of
an allreduce inside a tf.function.

`tf.numpy_function` costs about 0.3 ms of a training step before our kernel runs
(TensorFlow's py_func machinery and cold Python), and the engine's Python as much
again.  This op calls the engine's lane (`collectives.fusion.lane`) from C++: once
the engine has run the op and armed its slot, a step's gradient allreduce is the
lane's coordination allreduce and data allreduce, with no Python.  Anything else
(the first run, a cycle the engine must finish, an error) calls back into Python,
which runs it through the engine like every other op.

The op is compiled on first use against the installed TensorFlow (about 20 s) into
`$HOROVOD_SPARK_CACHE` (default ~/.cache/horovod_spark), once per TensorFlow
version and source, under a file lock so ranks sharing a host build it once.
HOROVOD_SPARK_TF_LANE=0 turns it off; where it cannot be built (no C++ compiler)
the ops keep `tf.numpy_function`, with one warning.
"""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import threading
import weakref
from typing import Optional

import numpy as np

from collectives import ReduceOp
from collectives.fusion import lane as fusion_lane

from . import _basics
from ._graph import check_not_xla, ordered
from ..settings import CACHE, TF_LANE

__all__ = ["enabled", "allreduce"]

log = logging.getLogger("horovod_spark.tensorflow")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lane_op.cc")
SOURCES = (SOURCE, os.path.join(os.path.dirname(SOURCE), "async_op.cc"))  # one library
_lock = threading.Lock()
_state: dict = {}  # "lib", "cdll", "error"
_slots: list = []  # slot -> (name, op, postscale, numpy dtype)
_engines: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()  # lane address -> engine
_bound = [None]

_CALLBACK_T = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
                               ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                               ctypes.c_int64)
_CTYPES = {np.dtype(np.float16): ctypes.c_uint16, np.dtype(np.float32): ctypes.c_float,
           np.dtype(np.float64): ctypes.c_double}


def enabled() -> bool:
    """HOROVOD_SPARK_TF_LANE, read once in this rank's process (not on every traced op)."""
    if _state.get("pid") != os.getpid():  # a rank forked from a zygote reads its own
        _state.update(pid=os.getpid(), enabled=TF_LANE.read())
    return _state["enabled"]


def _cache_dir() -> str:
    root = CACHE.read() or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "horovod_spark")
    return os.path.join(root, "tf-ops")


def _build(tf) -> str:
    """The path of the compiled library, building it if this TensorFlow has none yet."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("no C++ compiler (g++) on PATH; set CXX")
    flags = ["-std=c++17", "-O2", "-shared", "-fPIC", "-w"] + tf.sysconfig.get_compile_flags()
    flags = [f for f in flags if f != "--std=c++17"]
    link = tf.sysconfig.get_link_flags()
    source = b""
    for name in SOURCES:
        with open(name, "rb") as f:
            source += f.read()
    key = hashlib.sha256(source + repr((tf.__version__, flags, link, cxx, sys.version)).encode()
                         ).hexdigest()[:16]
    out_dir = os.path.join(_cache_dir(), key)
    path = os.path.join(out_dir, "hvs_tf_ops.so")
    if os.path.exists(path):
        return path
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # ranks on one host: one compiles, the others wait
        if not os.path.exists(path):
            tmp = f"{path}.{os.getpid()}.tmp"
            cmd = [cxx, *flags, *SOURCES, "-o", tmp, *link]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                raise RuntimeError(f"compiling {' '.join(SOURCES)} failed ({' '.join(cmd)}):\n"
                                   f"{proc.stderr[-3000:]}")
            os.replace(tmp, path)
    return path


def _library():
    """The loaded op library, or None where it is off or could not be built (warned once)."""
    if "lib" in _state or "error" in _state:
        return _state.get("lib")
    with _lock:
        if "lib" in _state or "error" in _state:
            return _state.get("lib")
        try:
            import tensorflow as tf

            path = _build(tf)
            lib = tf.load_op_library(path)
            cdll = ctypes.CDLL(path)
            cdll.hvs_tf_bind.argtypes = [ctypes.c_void_p] * 3
            cdll.hvs_tf_bind.restype = None
            _state["cdll"], _state["lib"] = cdll, lib
        except Exception as exc:  # the numpy_function path still works: say why once
            _state["error"] = exc
            log.warning("horovod_spark.tensorflow: the native allreduce op is unavailable, "
                        "allreduce in tf.function keeps tf.numpy_function: %s", exc)
        return _state.get("lib")


def _bind(engine) -> None:
    """Point the op at `engine`'s lane (or none: every run calls back into Python)."""
    lane = engine.lane if engine is not None else None
    address = lane.address if lane is not None else None
    if _bound[0] == address:
        return
    if lane is not None:
        _engines[address] = engine
    _state["cdll"].hvs_tf_bind(fusion_lane.run_address(), address, ctypes.cast(_callback, ctypes.c_void_p))
    _bound[0] = address


def _array(address: int, nbytes: int, dtype: np.dtype) -> np.ndarray:
    n = nbytes // dtype.itemsize  # > 0: empty tensors never get the op
    return np.ctypeslib.as_array(ctypes.cast(address, ctypes.POINTER(_CTYPES[dtype])),
                                 shape=(n,)).view(dtype)


@_CALLBACK_T
def _callback(code, lane, slot, src, dst, nbytes, err, errlen):
    """Every run the lane did not finish: through the engine (`FusionEngine.lane_op`)."""
    try:
        name, op, post, dtype = _slots[slot]
        codes = fusion_lane.codes()
        if code in (codes["handover"], codes["error"]):
            engine = _engines[lane]  # the engine whose lane holds the cycle
        else:
            engine = _basics.engine()
            _bind(engine)
        engine.lane_op(code, slot, name, _array(src, nbytes, dtype), _array(dst, nbytes, dtype), op,
                       post)
        return 0
    except BaseException as exc:  # becomes the op's error (a C callback must not raise)
        msg = f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")[:max(int(errlen) - 1, 0)]
        ctypes.memmove(err, msg, len(msg))
        ctypes.memset(err + len(msg), 0, 1)
        return 1


def allreduce(tf, x, name: str, op: ReduceOp, post: float) -> Optional[object]:
    """x allreduced by the native op, inside a tf.function; None where the op does not
    apply (eager mode, dtypes other than float16/32/64, ops other than Sum and Average, no
    native lane): the caller's path runs."""
    if tf.executing_eagerly() or not enabled() or op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        return None
    if not ordered():  # a blocking op where TensorFlow does not order them: see _async_op
        return None
    dtype = (np.dtype(x.dtype.as_numpy_dtype) if x.dtype in (tf.float16, tf.float32, tf.float64)
             else None)
    if dtype is None or not x.shape.is_fully_defined() or x.shape.num_elements() == 0:
        return None
    if _basics.engine().lane is None:  # another backend (MPI): numpy_function as before
        return None
    lib = _library()
    if lib is None:
        return None
    check_not_xla(name)
    _bind(_basics.engine())
    with _lock:
        slot = len(_slots)
        _slots.append((name, op, float(post), dtype))
    return lib.hvs_lane_allreduce(x, slot=slot)
