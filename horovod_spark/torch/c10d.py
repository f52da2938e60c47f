"""The "hvs" backend of torch.distributed: c10d's collectives over the package's transport.

    import torch.distributed as dist
    dist.init_process_group("hvs")     # in a job of this package: no import needed

Terms.  The *group* is a `ProcessGroupHVS`, a `dist.ProcessGroup` written in Python over a
`collectives.Communicator` (shared memory within a host, TCP between hosts, every
connection authenticated).  In a job of this package the group's communicator bootstraps
through the job's own authenticated store with the job's secret; under torchrun or any
env:// launcher it bootstraps through the c10d store it is given, with a secret rank 0 puts
there (no better than that store, which authenticates nobody).  An op becomes the backend's
op on the tensors' memory (`Communicator.flat`), queued for the group's thread (or run on
the caller's when torch waits for it at once) and returned as a c10d Work whose future
completes with it, so DDP's comm hooks chain on it and communication overlaps backward
(see `_c10d_work`).  Ops the transport has not (the bitwise reductions)
gather and reduce with torch; ops torch's backends have and this one has not raise
NotSupported naming the op and what to use.  CUDA tensors go to an inner NCCL group
(`"cpu:hvs,cuda:nccl"`: torch hands a Python group every device's tensors).
"""
from __future__ import annotations

import socket
import threading
from typing import List, Optional

import torch
import torch.distributed as dist
import torch._C._distributed_c10d as c10d

import collectives
from collectives import Communicator, NotSupported
from collectives.types import DType, ReduceOp

from ._c10d_work import Done as _done
from ._c10d_work import Queue

__all__ = ["ProcessGroupHVS", "register"]

NAME = "hvs"
_RED = dist.ReduceOp.RedOpType
_NATIVE = {_RED.SUM: ReduceOp.SUM, _RED.AVG: ReduceOp.AVERAGE, _RED.PRODUCT: ReduceOp.PRODUCT,
           _RED.MIN: ReduceOp.MIN, _RED.MAX: ReduceOp.MAX}
_BITWISE = {_RED.BAND: torch.bitwise_and, _RED.BOR: torch.bitwise_or,
            _RED.BXOR: torch.bitwise_xor}
_DTYPES = {torch.float16: DType.FLOAT16, torch.bfloat16: DType.BFLOAT16,
           torch.float32: DType.FLOAT32, torch.float64: DType.FLOAT64, torch.int8: DType.INT8,
           torch.int16: DType.INT16, torch.int32: DType.INT32, torch.int64: DType.INT64,
           torch.uint8: DType.UINT8, torch.bool: DType.BOOL}


class _Flat:
    """A CPU tensor's memory as the backend takes it: a flat numpy view, its DType, and the
    tensor it must be copied back into when it was not contiguous."""

    def __init__(self, tensor: torch.Tensor, op: str) -> None:
        if tensor.device.type != "cpu":
            raise NotSupported(f"hvs {op}: {tensor.device} tensors go to a group of their own "
                               f"backend; init_process_group('cpu:hvs,cuda:nccl') routes CUDA "
                               f"tensors to NCCL")
        dtype = _DTYPES.get(tensor.dtype)
        if dtype is None:
            raise TypeError(f"hvs {op}: unsupported dtype {tensor.dtype}; supported: "
                            + ", ".join(str(d) for d in _DTYPES))
        self.user, self.dtype = tensor, dtype
        self.tensor = t = tensor if tensor.is_contiguous() else tensor.contiguous()
        if t.requires_grad:
            t = t.detach()
        if dtype is DType.BFLOAT16:
            t = t.view(torch.int16)
        self.array = t.numpy() if t.dim() == 1 else t.numpy().reshape(-1)

    def back(self) -> None:
        if self.tensor is not self.user:
            self.user.copy_(self.tensor)


def _bind_address(master: str) -> str:
    """This host's address toward `master` (the route the kernel would take)."""
    if master in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((master, 9))
        return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        probe.close()


_made: dict = {}  # group id -> how many groups of that id this process made


def _communicator(store, rank: int, size: int, group_id: str, timeout_s: float) -> Communicator:
    """The group's communicator: in a job of this package, through the job's authenticated
    store with its secret; else through the c10d store, with a secret rank 0 leaves there."""
    import os

    from collectives import Config
    from collectives.launch.rankenv import RankEnv
    from collectives.rendezvous.auth import new_secret
    from collectives.rendezvous.store import ForeignStore

    config = Config.create(env=os.environ)
    if RankEnv.from_environ() is not None:  # a group id comes back after
        nth = _made[group_id] = _made.get(group_id, -1) + 1  # destroy_process_group: counted
        return collectives.init(config, group=f"c10d/{group_id}.{nth}", rank=rank, size=size)
    foreign = ForeignStore(store)
    if rank == 0:
        foreign.set("hvs/secret", new_secret())
    secret = foreign.get("hvs/secret", timeout_s)
    bind = _bind_address(os.environ.get("MASTER_ADDR", "127.0.0.1"))
    return Communicator.create(foreign, rank, size, socket.gethostname(), bind, secret, "hvs",
                               config)


class ProcessGroupHVS(dist.ProcessGroup):
    """A torch.distributed process group over a `collectives.Communicator` (see the module
    docstring)."""

    def __init__(self, comm: Communicator, rank: int, size: int, store=None) -> None:
        super().__init__(rank, size)
        self.comm, self._store = comm, store
        self._group_name = ""
        self._cuda: Optional[dist.ProcessGroup] = None
        self._pairs: dict = {}
        self._lock = threading.Lock()
        self._queue = Queue()

    def getBackendName(self) -> str:
        return NAME

    # torch names its groups through the backends a C++ group holds; this one holds none
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_name(self) -> str:
        return self._group_name

    @property
    def group_desc(self) -> str:
        return getattr(self, "_group_desc", self._group_name)

    def name(self) -> str:
        return NAME

    # -- running ---------------------------------------------------------
    def _run(self, op: str, *args, then=None, opts=None) -> "dist.Work":
        """The backend's op, queued or, when torch waits for it at once, run now (see
        `_c10d_work`); a Work whose future carries `then()` (the tensors torch expects back)."""
        flat = self.comm.flat
        if opts is not None and not opts.asyncOp:
            return self._queue.run_now(lambda: flat(op, *args, then=then))
        return self._queue.submit(lambda: flat(op, *args, then=then))

    def _nccl(self) -> dist.ProcessGroup:
        """The inner NCCL group for CUDA tensors, made on first use."""
        with self._lock:
            if self._cuda is None:
                if self._store is None or not dist.is_nccl_available():
                    raise NotSupported("hvs: CUDA tensors need NCCL, which this torch lacks; "
                                       "move the tensors to the CPU or use backend 'nccl'")
                prefixed = dist.PrefixStore("hvs-nccl", self._store)
                self._cuda = dist.ProcessGroupNCCL(prefixed, self.rank(), self.size())
            return self._cuda

    @staticmethod
    def _on_cuda(tensors) -> bool:
        return any(t.is_cuda for t in tensors)

    # -- the ops ---------------------------------------------------------
    def allreduce(self, tensors: List[torch.Tensor], opts=c10d.AllreduceOptions()):
        red = _op(opts.reduceOp)
        op = _NATIVE.get(red)
        if op is None:
            if self._on_cuda(tensors):
                return self._nccl().allreduce(tensors, opts)
            if red in _BITWISE:
                return self._bitwise(tensors, _BITWISE[red])
            raise NotSupported(f"hvs allreduce: reduce op {red} is NCCL's only; use SUM, AVG, "
                               f"PRODUCT, MIN, MAX, BAND, BOR or BXOR")
        if self._on_cuda(tensors):
            return self._nccl().allreduce(tensors, opts)
        work = None
        for f in [_Flat(t, "allreduce") for t in tensors]:
            if op is ReduceOp.AVERAGE:
                if not f.dtype.is_floating:
                    raise TypeError(f"hvs allreduce: AVG of {f.user.dtype} tensors; average "
                                    f"floating point tensors, or SUM and divide")
                work = self._run("allreduce", f.array, f.array, f.dtype, ReduceOp.SUM,
                                 then=lambda f=f: (f.tensor.div_(self.size()), f.back(),
                                                   tensors)[2], opts=opts)
            else:
                work = self._run("allreduce", f.array, f.array, f.dtype, op,
                                 then=lambda f=f: (f.back(), tensors)[1], opts=opts)
        return work

    allreduce_coalesced = allreduce

    def _bitwise(self, tensors, fn):
        for t in tensors:
            if t.is_floating_point():
                raise TypeError(f"hvs allreduce: bitwise reductions take integer or bool "
                                f"tensors, got {t.dtype}")
        gathered = [torch.empty((self.size(),) + tuple(t.shape), dtype=t.dtype) for t in tensors]
        for t, g in zip(tensors, gathered):
            self._allgather_into(g, t).wait()
            acc = g[0].clone()
            for row in g[1:]:
                acc = fn(acc, row)
            t.copy_(acc)
        return _done(tensors)

    def broadcast(self, tensors: List[torch.Tensor], opts=c10d.BroadcastOptions()):
        if self._on_cuda(tensors):
            return self._nccl().broadcast(tensors, opts)
        work = None
        for t in tensors:
            f = _Flat(t, "broadcast")
            work = self._run("broadcast", f.array, f.dtype, opts.rootRank,
                             then=lambda f=f: (f.back(), tensors)[1], opts=opts)
        return work

    def _allgather_into(self, output: torch.Tensor, input: torch.Tensor, opts=None):
        src, dst = _Flat(input, "allgather"), _Flat(output, "allgather")
        if dst.array.size != src.array.size * self.size() or dst.dtype != src.dtype:
            raise ValueError(f"hvs allgather: output of {output.numel()} {output.dtype} for "
                             f"{self.size()} x {input.numel()} {input.dtype}")
        n = src.array.size
        return self._run("allgather", src.array, dst.array, src.dtype, [n] * self.size(),
                         then=lambda: (dst.back(), [output])[1], opts=opts)

    def _allgather_base(self, output, input, opts=c10d.AllgatherOptions()):
        if input.is_cuda:
            return self._nccl()._allgather_base(output, input, opts)
        return self._allgather_into(output, input, opts)

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=c10d.AllgatherOptions()):
        return _each(self._allgather_base, outputs, inputs, opts)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def allgather(self, output_tensors, input_tensors, opts=c10d.AllgatherOptions()):
        if self._on_cuda(input_tensors):
            return self._nccl().allgather(output_tensors, input_tensors, opts)
        for outs, inp in zip(output_tensors, input_tensors):
            flat = torch.empty((self.size() * inp.numel(),), dtype=inp.dtype)
            self._allgather_into(flat, inp.contiguous().view(-1)).wait()
            for r, out in enumerate(outs):
                out.copy_(flat[r * inp.numel():(r + 1) * inp.numel()].view_as(out))
        return _done(output_tensors)

    allgather_coalesced = allgather

    def _reduce_scatter_into(self, output, input, red, opts=None):
        if red not in _NATIVE:
            raise NotSupported(f"hvs reduce_scatter: reduce op {red}; use SUM, AVG, PRODUCT, "
                               f"MIN or MAX")
        op = _NATIVE[red]
        src, dst = _Flat(input, "reduce_scatter"), _Flat(output, "reduce_scatter")
        n = dst.array.size
        if src.array.size != n * self.size() or dst.dtype != src.dtype:
            raise ValueError(f"hvs reduce_scatter: input of {input.numel()} {input.dtype} for "
                             f"{self.size()} x {output.numel()} {output.dtype}")

        def then():
            if op == ReduceOp.AVERAGE:
                dst.tensor.div_(self.size())
            dst.back()
            return [output]

        native = ReduceOp.SUM if op == ReduceOp.AVERAGE else op
        return self._run("reducescatter", src.array, dst.array, src.dtype, native,
                         [n] * self.size(), then=then, opts=opts)

    def _reduce_scatter_base(self, output, input, opts=c10d.ReduceScatterOptions()):
        if input.is_cuda:
            return self._nccl()._reduce_scatter_base(output, input, opts)
        return self._reduce_scatter_into(output, input, _op(opts.reduceOp), opts)

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=c10d.ReduceScatterOptions()):
        return _each(self._reduce_scatter_base, outputs, inputs, opts)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def reduce_scatter(self, output_tensors, input_tensors, opts=c10d.ReduceScatterOptions()):
        if self._on_cuda(output_tensors):
            return self._nccl().reduce_scatter(output_tensors, input_tensors, opts)
        for out, ins in zip(output_tensors, input_tensors):
            flat = torch.cat([t.reshape(-1) for t in ins])
            self._reduce_scatter_into(out, flat, _op(opts.reduceOp)).wait()
        return _done(output_tensors)

    def reduce(self, tensors, opts=c10d.ReduceOptions()):
        if self._on_cuda(tensors):
            return self._nccl().reduce(tensors, opts)
        for t in tensors:
            total = t.detach().clone()
            options = c10d.AllreduceOptions()
            options.reduceOp = opts.reduceOp
            self.allreduce([total], options).wait()
            if self.rank() == opts.rootRank:
                t.copy_(total)
        return _done(tensors)

    def gather(self, output_tensors, input_tensors, opts=c10d.GatherOptions()):
        inp = input_tensors[0]
        outs = output_tensors[0] if self.rank() == opts.rootRank else \
            [torch.empty_like(inp) for _ in range(self.size())]
        self.allgather([outs], [inp]).wait()
        return _done(output_tensors)

    def scatter(self, output_tensors, input_tensors, opts=c10d.ScatterOptions()):
        out = output_tensors[0]
        whole = torch.empty((self.size() * out.numel(),), dtype=out.dtype)
        if self.rank() == opts.rootRank:
            whole.copy_(torch.cat([t.reshape(-1) for t in input_tensors[0]]))
        self.broadcast([whole], _root(opts.rootRank)).wait()
        r = self.rank()
        out.copy_(whole[r * out.numel():(r + 1) * out.numel()].view_as(out))
        return _done(output_tensors)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes,
                      opts=c10d.AllToAllOptions()):
        if input.is_cuda:
            return self._nccl().alltoall_base(output, input, output_split_sizes,
                                              input_split_sizes, opts)
        size = self.size()
        rows_in = list(input_split_sizes) or [input.shape[0] // size] * size
        rows_out = list(output_split_sizes) or [output.shape[0] // size] * size
        row = input[0].numel() if input.dim() and input.shape[0] else 1
        src, dst = _Flat(input, "alltoall"), _Flat(output, "alltoall")
        return self._run("alltoall", src.array, [r * row for r in rows_in], dst.array,
                         [r * row for r in rows_out], src.dtype,
                         then=lambda: (dst.back(), [output])[1], opts=opts)

    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors, input_tensors, opts=c10d.AllToAllOptions()):
        src = torch.cat([t.reshape(-1) for t in input_tensors])
        dst = torch.empty(sum(t.numel() for t in output_tensors), dtype=src.dtype)
        self.alltoall_base(dst, src, [t.numel() for t in output_tensors],
                           [t.numel() for t in input_tensors]).wait()
        offset = 0
        for t in output_tensors:
            t.copy_(dst[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
        return _done(output_tensors)

    def barrier(self, opts=c10d.BarrierOptions()):
        return self._run("barrier", then=lambda: [], opts=opts)

    # -- point to point: a communicator per pair of ranks, made when they first talk --------
    def _pair(self, peer: int) -> Communicator:
        with self._lock:
            comm = self._pairs.get(peer)
            if comm is None:
                a, b = sorted((self.rank(), peer))
                comm = self._pairs[peer] = self.comm.subset([a, b], f"p2p-{a}-{b}")
            return comm

    def send(self, tensors, dst: int, tag: int = 0):
        pair = self._pair(dst)
        for t in tensors:
            f = _Flat(t, "send")
            pair.flat("broadcast", f.array, f.dtype, 0 if self.rank() < dst else 1)
        return _done(tensors)

    def recv(self, tensors, src: int, tag: int = 0):
        pair = self._pair(src)
        for t in tensors:
            f = _Flat(t, "recv")
            pair.flat("broadcast", f.array, f.dtype, 0 if src < self.rank() else 1)
            f.back()
        return _done(tensors)

    def recv_anysource(self, tensors, tag: int = 0):
        raise NotSupported("hvs recv: a receive from any source; name the source rank")

    def shutdown(self) -> None:
        self._queue.stop()
        for comm in (*self._pairs.values(), self.comm):
            comm.close()
        self._pairs = {}
        if self._cuda is not None:
            self._cuda.shutdown()


def _each(op, outputs, inputs, opts):
    """A coalesced op as one op per (output, input) pair, queued in order: the last one's
    Work ends after all of them (the queue runs them oldest first)."""
    work = None
    for o, i in zip(outputs, inputs):
        work = op(o, i, opts)
    return work


def _op(reduce_op):
    return reduce_op.op if isinstance(reduce_op, dist.ReduceOp) else reduce_op


def _root(rank: int) -> dist.BroadcastOptions:
    opts = c10d.BroadcastOptions()
    opts.rootRank = rank
    return opts


def _create(backend_opts, pg_options) -> ProcessGroupHVS:
    """torch's constructor hook (register_backend with extended_api)."""
    timeout = backend_opts.timeout.total_seconds()
    comm = _communicator(backend_opts.store, backend_opts.group_rank, backend_opts.group_size,
                         str(backend_opts.group_id), timeout)
    pg = ProcessGroupHVS(comm, backend_opts.group_rank, backend_opts.group_size,
                         backend_opts.store)
    pg._set_group_name(str(backend_opts.group_id))  # torch sets it again, as it does for any
    return pg


def register() -> None:
    """Make "hvs" a torch.distributed backend (once per process)."""
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu"])


register()
