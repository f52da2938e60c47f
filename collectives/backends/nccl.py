"""The NCCL backend: collectives on CUDA buffers through `cupy.cuda.nccl`.

Terms: a *CUDA buffer* is a torch CUDA tensor or a CuPy array (or anything
with the CUDA array interface or DLPack), used in place, zero-copy, through
its `DeviceBuffer` (pointer, count, device; see `collectives._gpu.DeviceBuffer`).  The
*stream* of an op is the framework's current stream for the buffer's device
(torch's for a torch tensor, CuPy's otherwise) unless the caller passes one:
NCCL enqueues there and returns, so the op is ordered with the user's
kernels and no host thread waits.  Callers that run an op on another thread
(async ops) capture `stream_of(x)` on the submitting thread and pass it.

Bootstrap (`create`): every rank publishes one record through the Store
(rank 0's carries the NCCL unique id; see _nccl_boot), ranks that share a
GPU are refused, and each rank calls ncclCommInitRank on its device.  What a
collective turns into (native call, grouped broadcasts / reduces, grouped
send / recv) is planned in _nccl_plan; dtypes and ops are mapped in
_nccl_types, which also holds the one function that turns an NCCL status
into our exception, keeping NCCL's own error string.  A watchdog
(_nccl_watchdog) aborts the communicator when an op outlives the timeout or
NCCL reports an asynchronous error; every later op then raises that error.

CuPy is imported lazily: `import collectives` never needs it.
"""
from __future__ import annotations

import sys
import threading
from typing import Optional, Sequence, Tuple

import numpy as np

from .._gpu import NCCL_INSTALL_HINT as INSTALL_HINT
from .._gpu import DeviceBuffer, current_stream, device_buffer, import_cupy_nccl
from ..settings import Config
from ..errors import CollectiveError, CollectiveTimeout, NotSupported, describe
from ..types import DType, ReduceOp, numpy_of_dtype
from . import _nccl_types as T
from ._nccl_plan import Call, check_counts, plan_allgather, plan_alltoall, plan_reducescatter
from .base import Backend, Topology

__all__ = ["NcclBackend", "available", "INSTALL_HINT"]

_D2D = 3  # cudaMemcpyDeviceToDevice
_CUDA_NOT_READY = 600  # cudaErrorNotReady: what an event query returns before the GPU gets there


def available() -> Tuple[bool, str]:
    """(True, 'NCCL x.y.z') or (False, what is missing and how to install it)."""
    try:
        _, nccl = import_cupy_nccl()
        return True, f"NCCL {T.version_text(nccl.get_version())}"
    except NotSupported as exc:
        return False, str(exc)


def _current_device(cupy) -> int:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.current_device())
    return int(cupy.cuda.runtime.getDevice())


class NcclBackend(Backend):
    """Collectives on CUDA buffers of one device; see the module docstring."""

    name = "nccl"

    def __init__(self, topology: Topology, comm, device: int, version: int, config: Config,
                 cupy, nccl) -> None:
        super().__init__(topology)
        self.device, self.version, self.config = device, version, config
        self._comm, self._cupy, self._nccl = comm, cupy, nccl
        self._lock = threading.RLock()
        self._seq = 0
        self._streams: dict = {}
        self._closed = False
        self._token = None  # the barrier's one-element device buffer
        from ._nccl_watchdog import Watchdog

        self._watchdog = Watchdog(config.timeout, comm.check_async_error, comm.abort,
                                  self._timeout_error, self._async_error, done=self._event_done)

    # -- construction ------------------------------------------------------
    @classmethod
    def create(cls, store, topology: Topology, prefix: str, config: Optional[Config] = None,
               device: Optional[int] = None) -> "NcclBackend":
        """Bootstrap NCCL on `device` (default: the current CUDA device) through `store`.

        `store` None exchanges the bootstrap records over MPI.COMM_WORLD (MPI backend).

        Raises:
            NotSupported: CuPy, NCCL or a GPU is missing.
            CollectiveError: ranks share a GPU, or NCCL failed to initialize.
        """
        cupy, nccl = import_cupy_nccl()
        config = config or Config()
        device = _current_device(cupy) if device is None else int(device)
        from ._nccl_boot import bootstrap

        with cupy.cuda.Device(device):
            identity = cupy.cuda.runtime.deviceGetPCIBusId(device)
            version = int(nccl.get_version())
            uid = bootstrap(store, topology, prefix, identity,
                            lambda: T.encode_unique_id(nccl.get_unique_id()), config.connect_timeout)
            comm = _init_comm(cupy, nccl, device, topology, uid, config.connect_timeout)
        return cls(topology, comm, device, version, config, cupy, nccl)

    # -- streams and buffers -----------------------------------------------
    def stream_of(self, x=None) -> int:
        """The current stream (cudaStream_t as int) of x's framework (CuPy's for None)."""
        return current_stream(x, self.device, self._cupy)

    def _cupy_stream(self, ptr: int):
        """A CuPy stream object for `ptr` (cached), to run CuPy kernels and record events on."""
        s = self._streams.get(ptr)
        if s is None:
            import warnings

            with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream, still exact
                warnings.simplefilter("ignore", DeprecationWarning)
                s = self._cupy.cuda.ExternalStream(ptr, self.device)
            self._streams[ptr] = s
        return s

    def _buf(self, x, dtype: DType, what: str) -> DeviceBuffer:
        b = device_buffer(x, what)
        if b.device != self.device:
            raise ValueError(f"{what}: the buffer is on cuda:{b.device} but this rank's NCCL "
                             f"communicator is on cuda:{self.device}")
        if b.itemsize != DType(dtype).itemsize:
            raise ValueError(f"{what}: {b.itemsize}-byte elements do not hold {DType(dtype).name.lower()}")
        return b

    def _view(self, b: DeviceBuffer, np_dtype, count: Optional[int] = None):
        """A CuPy array over b's memory (no copy)."""
        cupy = self._cupy
        mem = cupy.cuda.UnownedMemory(b.ptr, max(b.nbytes, 1), b.owner, b.device)
        n = b.nbytes // np.dtype(np_dtype).itemsize if count is None else count
        return cupy.ndarray((n,), dtype=np_dtype, memptr=cupy.cuda.MemoryPointer(mem, 0))

    def _wrap(self, arr) -> DeviceBuffer:
        return DeviceBuffer(int(arr.data.ptr), int(arr.size), int(arr.itemsize), self.device, "cupy", arr)

    # -- the calls ---------------------------------------------------------
    def _enqueue(self, op: str, tensor: str, stream: int, body) -> None:
        """Run `body()` (NCCL calls on `stream`) under the lock; errors become ours."""
        with self._lock:
            self._seq += 1
            self._raise_if_broken(op, tensor)
            nccl = self._nccl
            try:
                with self._cupy.cuda.Device(self.device):
                    body()
                    event = self._cupy.cuda.Event(disable_timing=True)
                    event.record(self._cupy_stream(stream))
            except (nccl.NcclError, KeyError) as exc:
                status = T.status_of(exc, nccl)
                if status is None:  # a KeyError of ours, not NCCL's
                    raise
                raise T.translate_nccl_error(status[0], status[1], rank=self.rank,
                                             size=self.size, op=op, seq=self._seq,
                                             tensor=tensor) from exc
            except RuntimeError as exc:  # CUDARuntimeError, or CuPy's "... not available in this version"
                kind = NotSupported if "not available in this version" in str(exc) else CollectiveError
                raise kind(describe(f"{type(exc).__name__}: {exc}", rank=self.rank, size=self.size,
                                    op=op, seq=self._seq, tensor=tensor)) from exc
            self._watchdog.track(event, op, self._seq, tensor)

    def _raise_if_broken(self, op: str, tensor: Optional[str]) -> None:
        if self._closed:
            raise CollectiveError(describe("the NCCL backend is closed", rank=self.rank,
                                           size=self.size, op=op, seq=self._seq, tensor=tensor))
        err = self._watchdog.error
        if err is not None:
            raise type(err)(describe(f"NCCL communicator was aborted by an earlier failure: {err}",
                                     rank=self.rank, size=self.size, op=op, seq=self._seq,
                                     tensor=tensor))

    def _timeout_error(self, op, seq, tensor, age) -> CollectiveError:
        return CollectiveTimeout(describe(f"the op did not complete on the GPU ({age:.0f} s since "
                                          "it was enqueued); the communicator was aborted",
                                          rank=self.rank, size=self.size, op=op, seq=seq,
                                          tensor=tensor, timeout=self.config.timeout,
                                          hint="is every rank alive and calling the same collectives?"))

    def _async_error(self, exc) -> CollectiveError:
        status = T.status_of(exc, self._nccl) or (getattr(exc, "status", -1), str(exc))
        return T.translate_nccl_error(status[0], status[1], rank=self.rank, size=self.size,
                                      op="nccl (asynchronous)")

    def _event_done(self, event) -> bool:
        """Whether the GPU passed `event`; a CUDA error there (a sticky one: an illegal
        address, say) raises instead of looking like an op that never finishes."""
        status = int(self._cupy.cuda.runtime.eventQuery(event.ptr))
        if status in (0, _CUDA_NOT_READY):
            return status == 0
        try:
            text = self._cupy.cuda.runtime.getErrorString(status)
        except Exception:  # noqa: BLE001 - the code alone still says it
            text = "CUDA error"
        raise CollectiveError(describe(f"CUDA error {status} ({text}) on the stream of an NCCL op",
                                       rank=self.rank, size=self.size, op="nccl",
                                       hint="CUDA errors are sticky: the process must restart"))

    def _run_plan(self, calls: Sequence[Call], s: DeviceBuffer, d: DeviceBuffer, ntype: int,
                  nop: int, stream: int) -> None:
        comm, nccl = self._comm, self._nccl
        grouped = len(calls) > 1
        if grouped:
            nccl.groupStart()
        try:
            for c in calls:
                self._issue(comm, c, s, d, ntype, nop, stream)
        except BaseException:
            if grouped:
                try:
                    nccl.groupEnd()
                except Exception:  # noqa: BLE001 - the first error is the one to report
                    pass
            raise
        if grouped:
            nccl.groupEnd()

    def _issue(self, comm, c: Call, s: DeviceBuffer, d: DeviceBuffer, ntype: int, nop: int,
               stream: int) -> None:
        src = (d if c.src_buf == "dst" else s).at(c.src_off)
        if c.kind == "allreduce":
            comm.allReduce(src, d.ptr, c.count, ntype, nop, stream)
        elif c.kind == "allgather":
            comm.allGather(src, d.ptr, c.count, ntype, stream)
        elif c.kind == "broadcast":
            comm.broadcast(src, d.at(c.dst_off), c.count, ntype, c.peer, stream)
        elif c.kind == "reducescatter":
            comm.reduceScatter(src, d.ptr, c.count, ntype, nop, stream)
        elif c.kind == "reduce":
            out = d.at(c.dst_off) if c.peer == self.rank else src  # ignored off the root
            comm.reduce(src, out, c.count, ntype, nop, c.peer, stream)
        elif c.kind == "send":
            comm.send(src, c.count, ntype, c.peer, stream)
        elif c.kind == "recv":
            comm.recv(d.at(c.dst_off), c.count, ntype, c.peer, stream)
        elif c.kind == "copy":
            self._cupy.cuda.runtime.memcpyAsync(d.at(c.dst_off), src, c.count * s.itemsize, _D2D, stream)
        else:
            raise AssertionError(f"unknown NCCL call {c.kind!r}")

    # -- collectives on flat CUDA buffers ----------------------------------
    def allreduce(self, src, dst, dtype: DType, op: ReduceOp, stream: Optional[int] = None) -> None:
        self.allreduce_tensor(src, dst, dtype, op, stream=stream)

    def allreduce_tensor(self, src, dst, dtype: DType, op: ReduceOp, prescale: float = 1.0,
                         postscale: float = 1.0, stream: Optional[int] = None):
        """dst = postscale * reduce(prescale * src); dst may be src.  Returns dst."""
        s, d = self._buf(src, dtype, "allreduce input"), self._buf(dst, dtype, "allreduce output")
        if s.count != d.count:
            raise ValueError(f"allreduce: input has {s.count} elements, output {d.count}")
        stream = self.stream_of(src) if stream is None else int(stream)
        calls = [Call("allreduce", d.count)] if d.count else []

        def body():
            first = s
            if prescale != 1.0:
                if d.ptr != s.ptr:
                    self._cupy.cuda.runtime.memcpyAsync(d.ptr, s.ptr, s.nbytes, _D2D, stream)
                self._scale(d, dtype, prescale, stream)
                first = d
            self._reduce(calls, first, d, dtype, op, stream, d.count)
            self._scale(d, dtype, postscale, stream)

        self._enqueue("allreduce", _tensor(dtype, d.count), stream, body)
        return dst

    def allgather(self, src, dst, dtype: DType, counts: Sequence[int],
                  stream: Optional[int] = None) -> None:
        s, d = self._buf(src, dtype, "allgather input"), self._buf(dst, dtype, "allgather output")
        check_counts("allgather", s.count, d.count, counts, self.rank, mine_is="input")
        stream = self.stream_of(src) if stream is None else int(stream)
        calls = plan_allgather(counts, self.rank)
        ntype = T.transfer_type(dtype)
        self._enqueue("allgather", _tensor(dtype, d.count), stream,
                      lambda: self._run_plan(calls, s, d, ntype, 0, stream))

    def broadcast(self, buf, dtype: DType, root: int, stream: Optional[int] = None) -> None:
        b = self._buf(buf, dtype, "broadcast buffer")
        stream = self.stream_of(buf) if stream is None else int(stream)
        calls = [Call("broadcast", b.count, peer=int(root), src_buf="dst")] if b.count else []
        ntype = T.transfer_type(dtype)
        self._enqueue("broadcast", _tensor(dtype, b.count), stream,
                      lambda: self._run_plan(calls, b, b, ntype, 0, stream))

    def reducescatter(self, src, dst, dtype: DType, op: ReduceOp, counts: Sequence[int],
                      stream: Optional[int] = None) -> None:
        s, d = self._buf(src, dtype, "reducescatter input"), self._buf(dst, dtype, "reducescatter output")
        check_counts("reducescatter", d.count, s.count, counts, self.rank, mine_is="output")
        stream = self.stream_of(src) if stream is None else int(stream)
        calls = plan_reducescatter(counts, self.rank)
        self._enqueue("reducescatter", _tensor(dtype, s.count), stream,
                      lambda: self._reduce(calls, s, d, dtype, op, stream, d.count))

    def alltoall(self, src, send_counts: Sequence[int], dst, recv_counts: Sequence[int],
                 dtype: DType, stream: Optional[int] = None) -> None:
        s, d = self._buf(src, dtype, "alltoall input"), self._buf(dst, dtype, "alltoall output")
        if s.count != sum(send_counts) or d.count != sum(recv_counts):
            raise ValueError(f"alltoall: buffers of {s.count} / {d.count} elements do not match "
                             f"send counts {list(send_counts)} / receive counts {list(recv_counts)}")
        stream = self.stream_of(src) if stream is None else int(stream)
        calls = plan_alltoall(send_counts, recv_counts, self.rank)
        ntype = T.transfer_type(dtype)
        self._enqueue("alltoall", _tensor(dtype, s.count), stream,
                      lambda: self._run_plan(calls, s, d, ntype, 0, stream))

    def barrier(self) -> None:
        """Every rank reaches here, and this rank's queued NCCL work is done."""
        with self._cupy.cuda.Device(self.device):
            if self._token is None:
                self._token = self._cupy.zeros(1, dtype=np.int32)
        b = self._wrap(self._token)
        stream = self.stream_of(None)
        self._enqueue("barrier", None, stream, lambda: self._run_plan(
            [Call("allreduce", 1)], b, b, T.NCCL_INT32, T.NCCL_SUM, stream))
        self.synchronize()

    def synchronize(self, timeout: Optional[float] = None) -> None:
        """Block until every op this backend enqueued has finished on the GPU."""
        wait = self.config.timeout + 1.0 if timeout is None else timeout
        if self._watchdog.wait_idle(wait):
            return
        err = self._watchdog.error
        if err is not None:
            raise type(err)(str(err))
        raise CollectiveTimeout(describe("NCCL ops still running on the GPU", rank=self.rank,
                                         size=self.size, op="synchronize", timeout=wait))

    def close(self) -> None:
        """Wait briefly for queued ops, then destroy the communicator.  Safe twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        clean = self._watchdog.error is None and self._watchdog.wait_idle(min(self.config.timeout, 10.0))
        self._watchdog.close()
        try:
            if clean:
                self._comm.destroy()
            else:
                self._comm.abort()
        except Exception:  # noqa: BLE001 - already aborted by the watchdog
            pass
        self._streams.clear()

    # -- element-wise work on the op's stream ------------------------------
    def _reduce(self, calls, s: DeviceBuffer, d: DeviceBuffer, dtype: DType, op: ReduceOp,
                stream: int, out_count: int) -> None:
        plan = T.reduce_plan(dtype, op, self.version)
        if not calls:
            return
        if plan.widen_to is None:
            self._run_plan(calls, s, d, plan.nccl_type, plan.nccl_op, stream)
            return
        # Widened temporaries come from CuPy's pool on this stream, so their
        # reuse is ordered after the NCCL kernels that read them.
        storage = numpy_of_dtype(dtype)
        with self._cupy_stream(stream):
            ws = self._view(s, storage, s.count).astype(plan.widen_to)
            wd = self._cupy.empty(out_count, dtype=plan.widen_to)
            self._run_plan(calls, self._wrap(ws), self._wrap(wd), plan.nccl_type, plan.nccl_op, stream)
            if out_count:
                self._view(d, storage, out_count)[...] = wd.astype(storage)

    def _scale(self, b: DeviceBuffer, dtype: DType, factor: float, stream: int) -> None:
        if factor == 1.0 or b.count == 0:
            return
        cupy = self._cupy
        with self._cupy_stream(stream):
            if DType(dtype) == DType.BFLOAT16:
                bits = self._view(b, np.uint16, b.count)
                wide = (bits.astype(np.uint32) << np.uint32(16)).view(np.float32) * np.float32(factor)
                bits[...] = T.round_bf16(cupy, wide)
            else:
                v = self._view(b, numpy_of_dtype(dtype), b.count)
                # float16 scales by a float32 factor, as the CPU paths do (1/3 in float16 is 0.33325)
                f = np.float32(factor) if v.dtype == np.float16 else v.dtype.type(factor)
                cupy.multiply(v, f, out=v, casting="unsafe")


def _tensor(dtype: Optional[DType], count: int) -> Optional[str]:
    return None if dtype is None else f"{DType(dtype).name.lower()}[{count}]"


def _init_comm(cupy, nccl, device: int, topology: Topology, uid: bytes, timeout: float):
    """ncclCommInitRank, bounded: a rank that never joins makes the others raise, not hang.

    The init runs in a daemon thread, since NCCL's blocking init has no timeout
    of its own; after `timeout` the caller gets a CollectiveTimeout and the
    stuck thread is abandoned with the process, which is failing anyway.  The
    unique id goes in the first form this CuPy takes (T.unique_id_forms).
    """
    out: dict = {}

    def init():
        try:
            with cupy.cuda.Device(device):
                for form in T.unique_id_forms(uid):
                    try:
                        out["comm"] = nccl.NcclCommunicator(topology.size, form, topology.rank)
                        return
                    except (TypeError, OverflowError) as exc:  # not this CuPy's form
                        out["error"] = exc
        except BaseException as exc:  # handed to the caller below
            out["error"] = exc

    thread = threading.Thread(target=init, name="nccl-init", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise CollectiveTimeout(describe(
            "ncclCommInitRank did not finish", rank=topology.rank, size=topology.size,
            op="nccl init", timeout=timeout,
            hint="did every rank reach NCCL init? (a rank that died or took another path; "
                 "NCCL_SOCKET_IFNAME, NCCL_DEBUG=INFO help between hosts)"))
    if "comm" in out:
        return out["comm"]
    exc = out.get("error")
    status = T.status_of(exc, nccl)
    if status is not None:
        raise T.translate_nccl_error(status[0], status[1], rank=topology.rank,
                                     size=topology.size, op="nccl init") from exc
    raise exc
