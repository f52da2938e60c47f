"""Running the ops every rank agreed on, in the same order on every rank.

A *response* is one agreed signature with this rank's request for it (None
on a rank that has joined: it takes part with zeros).  Allreduce responses
are bucketed by (dtype, reduce op) in the order they were agreed; a bucket
is cut into *fusion groups* of at most `fusion_threshold` bytes.  A group of
several tensors is *packed* into the fusion buffer (one reusable array per
storage dtype; the prescale factor is applied while copying in), reduced by
one collective in place, and *unpacked* (the postscale factor is applied
while copying out).  AVERAGE is SUM with a postscale of 1/size.  bfloat16
is packed widened to float32 (the communicator's numpy path has no
bfloat16), so its sums are also more accurate.  A group of one CPU tensor
skips the copies.  CUDA tensors of one framework are packed the same way into
a *device* fusion buffer (one per dtype and framework, on the GPU; one
concatenation kernel in, one copy per tensor out) and reduced by one NCCL
call on the engine stream (`_streams`: after the producers' ready events;
the handles finish once the done event is recorded after the cycle's device
ops), so packing, the reduction and unpacking stay in order; a lone CUDA
tensor goes to the communicator as it is.

The other kinds run one collective each.  Errors that every rank can derive
from the agreed data (a broadcast root that has joined) finish the handles
without any communication, so no rank waits for a collective the others skip.
"""
from __future__ import annotations

import math
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from ..errors import NotSupported, describe
from ..types import DType, ReduceOp, numpy_of_dtype
from ._device import clone as _clone, concat as _concat, empty_like as _empty_like, \
    is_torch as _is_torch
from ._host import BF16 as _BF16, movable as _movable, narrow_bf16 as _narrow_bf16, \
    pack as _pack, scale as _scale
from ._streams import EngineStreams
from .request import Request, Signature

__all__ = ["Executor"]

Response = Tuple[Signature, Optional[Request]]
_AVERAGE, _SUM, _ADASUM = int(ReduceOp.AVERAGE), int(ReduceOp.SUM), int(ReduceOp.ADASUM)
# Plain dicts on the hot path: an enum lookup costs more than the copy of a small tensor.
_NUMPY = {int(d): numpy_of_dtype(d) for d in DType}
_STORAGE = {**_NUMPY, _BF16: np.dtype(np.float32)}  # what a fusion buffer holds
_FUSED_DTYPE = {int(d): (DType.FLOAT32 if d == DType.BFLOAT16 else d) for d in DType}


class Executor:
    def __init__(self, comm, threshold: int, timeline, metrics: Dict[str, float],
                 done: Callable[[Request, object, Optional[BaseException]], None]) -> None:
        self._comm, self.threshold = comm, threshold
        self.timeline, self._metrics, self._finish = timeline, metrics, done
        self._rank, self._size = comm.rank, comm.size
        # numpy dtype -> host fusion buffer; (torch?, dtype name) -> flat CUDA buffer
        self._buffers: Dict[object, object] = {}
        self.streams = EngineStreams()
        self._deferred: Optional[list] = None  # CUDA completions until the done event exists

    # -- dispatch ------------------------------------------------------------
    def run(self, responses: List[Response], joined: tuple, cuda: bool = False) -> None:
        """Run the agreed ops.  cuda: some may be CUDA ops, which run on the engine stream
        after their producers (ready events) and finish once the done event is recorded."""
        device = [req for _, req in responses if req is not None and req.sig.device != "cpu"] \
            if cuda else None
        if not device:
            return self._run(responses, joined)
        deferred: list = []
        self._deferred = deferred
        try:
            with self.streams.cycle(device) as record_done:
                self._run(responses, joined)
                event = record_done()
        finally:
            self._deferred = None
        for req, result, error in deferred:
            if error is None:  # fresh: not the caller's own tensor, so allocated on the engine stream
                mine = req.out.source if req.out is not None else req.buf.source
                req.handle.event = (event, result is not mine)
            self._finish(req, result, error)

    def _done(self, req: Request, result, error: Optional[BaseException]) -> None:
        if self._deferred is not None and req.sig.device != "cpu":
            self._deferred.append((req, result, error))
        else:
            self._finish(req, result, error)

    def _run(self, responses: List[Response], joined: tuple) -> None:
        buckets: Dict[tuple, list] = {}
        others: List[Response] = []
        anyone_joined = any(joined)
        for sig, req in responses:
            error = self._derived_error(sig, joined) if anyone_joined else None
            if error is not None:
                if req is not None:
                    self._done(req, None, error)
            elif sig.kind == "allreduce":
                self._bucket(buckets, sig, req)
            else:
                others.append((sig, req))
        for groups in buckets.values():
            for group, _ in groups:
                self._allreduce_group(group)
        for sig, req in others:
            getattr(self, f"_{sig.kind}")(sig, req)

    def _bucket(self, buckets, sig: Signature, req) -> None:
        op = _SUM if sig.op == _AVERAGE else sig.op
        groups = buckets.setdefault((sig.dtype, op, sig.device), [])
        nbytes = math.prod(sig.shape) * _STORAGE[sig.dtype].itemsize
        if not groups or groups[-1][1] + nbytes > self.threshold:
            groups.append([[], 0])
        groups[-1][0].append((sig, req))
        groups[-1][1] += nbytes

    def _derived_error(self, sig: Signature, joined: tuple) -> Optional[BaseException]:
        who = [r for r in range(self._size) if joined[r]]
        if not who:
            return None
        text = None
        if sig.kind == "broadcast" and joined[sig.root]:
            text = f"the broadcast root, rank {sig.root}, has joined"
        elif sig.strict_join:  # Horovod's rule: a joined rank has no tensor to give
            text = f"{sig.kind} cannot run while ranks {who} have joined"
        elif sig.kind == "alltoall":
            text = f"alltoall cannot run while ranks {who} have joined"
        elif sig.device != "cpu":
            text = f"joined ranks cannot take part in a {sig.device} op (ranks {who} have joined)"
        if text is None:
            return None
        return NotSupported(describe(text, rank=self._rank, size=self._size, op=sig.kind,
                                     tensor=sig.tensor(), hint="finish every op before join()"))

    # -- allreduce -------------------------------------------------------------
    def _reused(self, key, n: int, alloc):
        """The first n elements of the buffer kept under key, grown (doubling) by alloc(size)."""
        buf = self._buffers.get(key)
        if buf is None or buf.shape[0] < n:
            buf = self._buffers[key] = alloc(max(n, 2 * (0 if buf is None else buf.shape[0])))
        return buf[:n]

    def _fusion_buffer(self, dtype: np.dtype, n: int) -> np.ndarray:
        return self._reused(dtype, n, lambda size: np.empty(size, dtype))

    def _post(self, sig: Signature) -> float:
        """The postscale factor of sig's result (AVERAGE divides by the world size)."""
        return sig.postscale / self._size if sig.op == _AVERAGE else sig.postscale

    @staticmethod
    def _result_flat(req: Request, sig: Signature, count: int) -> np.ndarray:
        if req.out is not None:
            return req.out.flat
        return np.empty(count, _NUMPY[sig.dtype])

    def _finish_allreduce(self, req: Request, sig: Signature, flat: np.ndarray) -> None:
        if req.out is not None:
            self._done(req, req.out.source, None)
        else:
            self._done(req, req.buf.wrap(flat.reshape(sig.shape)), None)

    def _allreduce_group(self, group: List[Response]) -> None:
        sig0 = group[0][0]
        if sig0.op == _ADASUM:
            return self._adasum_group(group)
        op = ReduceOp.SUM if sig0.op == _AVERAGE else ReduceOp(sig0.op)
        if sig0.device != "cpu":
            torch_flags = {_is_torch(req.buf.flat) for _, req in group}
            if len(group) > 1 and len(torch_flags) == 1:
                return self._allreduce_device_group(group, op)
            for sig, req in group:  # one tensor, or torch and CuPy mixed: one by one
                self._allreduce_device(sig, req, op)
            return
        if len(group) == 1 and sig0.dtype != _BF16:
            return self._allreduce_single(sig0, group[0][1], op)
        name = f"fusion.{sig0.name}+{len(group) - 1}"
        self._fused(group, lambda fused, dtype, counts: self._comm.allreduce_flat(
            fused, fused, dtype, op, name=name))

    def _adasum_group(self, group: List[Response]) -> None:
        """Adasum of a fusion group: packed as a sum's (prescaled, bfloat16 widened), combined
        in place with each tensor as its own segment (`Communicator.adasum_flat`), unpacked."""
        sig0 = group[0][0]
        name = sig0.name if len(group) == 1 else f"fusion.{sig0.name}+{len(group) - 1}"
        self._fused(group, lambda fused, dtype, counts: self._comm.adasum_flat(
            fused, dtype, counts, name=name))

    def _fused(self, group: List[Response], collective) -> None:
        """Pack the group into the fusion buffer, run collective(fused, dtype, counts) on it in
        place, unpack every member's part (postscale, bfloat16 narrowed) and account for it."""
        sig0 = group[0][0]
        t0 = time.perf_counter()
        counts = [math.prod(sig.shape) for sig, _ in group]
        total = sum(counts)
        fused = self._fusion_buffer(_STORAGE[sig0.dtype], total)
        offsets = self._pack_group(fused, group, counts)
        t1 = time.perf_counter()
        collective(fused, _FUSED_DTYPE[sig0.dtype], counts)
        t2 = time.perf_counter()
        plain = sig0.dtype != _BF16
        for (sig, req), off, n in zip(group, offsets, counts):
            if req is None:
                continue
            if plain and req.out is not None and self._post(sig) == 1.0:  # the common case, inline
                np.copyto(req.out.flat, fused[off:off + n])
                self._done(req, req.out.source, None)
            else:
                self._unpack(fused[off:off + n], req, sig, n)
        t3 = time.perf_counter()
        self._account(group, total * fused.itemsize, (t0, t1, t2, t3))

    @staticmethod
    def _pack_group(fused: np.ndarray, group: List[Response], counts: List[int]) -> List[int]:
        """Copy every member into the fusion buffer; returns their offsets."""
        offsets, off = [], 0
        for n in counts:
            offsets.append(off)
            off += n
        if all(req is not None and sig.prescale == 1.0 for sig, req in group) and \
                group[0][0].dtype != _BF16:
            np.concatenate([req.buf.flat for _, req in group], out=fused)  # one call, no loop
            return offsets
        for (sig, req), off, n in zip(group, offsets, counts):
            _pack(fused[off:off + n], req, sig)
        return offsets

    def _unpack(self, part: np.ndarray, req: Request, sig: Signature, count: int) -> None:
        post = self._post(sig)
        dst = self._result_flat(req, sig, count)
        if sig.dtype == _BF16:
            _scale(part, post)
            _narrow_bf16(part, dst)
        elif post != 1.0:
            np.multiply(part, np.float32(post) if part.dtype == np.float16 else post, out=dst,
                        casting="unsafe")
        else:
            np.copyto(dst, part)
        self._finish_allreduce(req, sig, dst)

    def _allreduce_single(self, sig: Signature, req: Optional[Request], op: ReduceOp) -> None:
        t0 = time.perf_counter()
        post = self._post(sig)
        count = math.prod(sig.shape)
        if req is None:
            src = dst = np.zeros(count, _NUMPY[sig.dtype])
        else:
            src, dst = req.buf.flat, self._result_flat(req, sig, count)
        if sig.prescale != 1.0:  # (a copy: the input stays as the caller gave it)
            self._comm.allreduce(src, out=src if dst is src else dst, op=op,
                                 prescale=sig.prescale, postscale=post, name=sig.name)
        else:
            self._comm.allreduce_flat(src, dst, _FUSED_DTYPE[sig.dtype], op, post, sig.name)
        t1 = time.perf_counter()
        if req is not None:
            self._finish_allreduce(req, sig, dst)
        self._account([(sig, req)], sig.nbytes, (t0, t0, t1, t1))

    def _device_buffer(self, like, n: int):
        return self._reused((_is_torch(like), str(like.dtype)), n, lambda size: _empty_like(like, size))

    def _allreduce_device_group(self, group: List[Response], op: ReduceOp) -> None:
        """CUDA tensors (every rank holds them: joined ranks refuse device ops) in one buffer."""
        t0 = time.perf_counter()
        sig0 = group[0][0]
        counts = [math.prod(sig.shape) for sig, _ in group]
        fused = self._device_buffer(group[0][1].buf.flat, sum(counts))
        _concat([req.buf.flat for _, req in group], fused)
        offsets, off = [], 0
        for (sig, _), n in zip(group, counts):
            offsets.append(off)
            if sig.prescale != 1.0:
                fused[off:off + n] *= sig.prescale
            off += n
        t1 = time.perf_counter()
        self._comm.allreduce(fused, out=fused, op=op, name=f"fusion.{sig0.name}+{len(group) - 1}")
        t2 = time.perf_counter()
        for (sig, req), off, n in zip(group, offsets, counts):
            part = fused[off:off + n]
            post = self._post(sig)
            if req.out is not None:
                dst = req.out.flat
                dst[...] = part
                result = req.out.source
            else:
                dst = _clone(part)
                result = dst.reshape(sig.shape)
            if post != 1.0:
                dst *= post
            self._done(req, result, None)
        itemsize = fused.element_size() if _is_torch(fused) else fused.itemsize
        self._account(group, sum(counts) * itemsize, (t0, t1, t2, time.perf_counter()))

    def _allreduce_device(self, sig: Signature, req: Optional[Request], op: ReduceOp) -> None:
        t0 = time.perf_counter()
        post = self._post(sig)
        out = req.out.source if req.out is not None else None
        result = self._comm.allreduce(req.buf.source, out=out, op=op, prescale=sig.prescale,
                                      postscale=post, name=sig.name)
        t1 = time.perf_counter()
        self._done(req, result, None)
        self._account([(sig, req)], sig.nbytes, (t0, t0, t1, t1))

    def _account(self, group: List[Response], nbytes: int, times: tuple) -> None:
        m = self._metrics
        m["allreduce_tensors"] += len(group)
        m["allreduce_bytes"] += nbytes
        m["collectives"] += 1
        m["collective_s"] += times[2] - times[1]
        if len(group) > 1:
            m["fused_buffers"] += 1
        tl = self.timeline  # read once: a user thread may stop the timeline meanwhile
        if tl is not None:
            self._trace(tl, group, times)

    @staticmethod
    def _trace(tl, group: List[Response], times: tuple) -> None:
        t0, t1, t2, t3 = times
        fused = len(group) > 1
        for sig, req in group:
            if req is None:
                continue
            args = {"fused": len(group)} if fused else None
            tl.span(sig.name, "NEGOTIATE", req.t_submit, req.t_ready)
            tl.span(sig.name, "QUEUE", req.t_ready, t0)
            if fused:
                tl.span(sig.name, "MEMCPY_IN_FUSION_BUFFER", t0, t1)
            tl.span(sig.name, sig.kind.upper(), t1, t2, args)
            if fused:
                tl.span(sig.name, "MEMCPY_OUT_FUSION_BUFFER", t2, t3)

    # -- the other kinds -----------------------------------------------------
    def _timed(self, sig: Signature, req: Optional[Request], fn):
        t0 = time.perf_counter()
        result = fn()
        t1 = time.perf_counter()
        self._metrics["collectives"] += 1
        self._metrics["collective_s"] += t1 - t0
        tl = self.timeline  # read once: a user thread may stop the timeline meanwhile
        if tl is not None and req is not None:
            tl.span(sig.name, "NEGOTIATE", req.t_submit, req.t_ready)
            tl.span(sig.name, "QUEUE", req.t_ready, t0)
            tl.span(sig.name, sig.kind.upper(), t0, t1)
        return result

    def _zeros(self, sig: Signature, rows: Optional[int] = None) -> np.ndarray:
        shape = sig.shape if rows is None else (rows,) + sig.shape[1:]
        return np.zeros(shape, numpy_of_dtype(DType(sig.dtype)))

    def _allgather(self, sig: Signature, req: Optional[Request]) -> None:
        if req is not None and req.buf.kind == "cuda":
            return self._done(req, self._timed(sig, req, lambda: self._comm.allgather(
                req.buf.source, name=sig.name)), None)
        x = self._zeros(sig, 0) if req is None else req.buf.flat.reshape(sig.shape)
        out = self._timed(sig, req, lambda: self._comm.allgather(_movable(x, sig.dtype), name=sig.name))
        if req is not None:
            out = np.asarray(out).view(x.dtype)
            self._done(req, req.buf.wrap(out), None)

    def _broadcast(self, sig: Signature, req: Optional[Request]) -> None:
        if req is not None and req.buf.kind == "cuda":  # torch or CuPy: both index-assign
            src = req.buf.source
            target = src if req.out is None else req.out.source
            if req.out is None:
                target = src.clone() if hasattr(src, "clone") else src.copy()
            elif target is not src:
                target[...] = src
            self._timed(sig, req, lambda: self._comm.broadcast(target, root=sig.root, name=sig.name))
            return self._done(req, target, None)
        if req is None:
            flat = self._zeros(sig).reshape(-1)
        elif req.out is None:
            flat = req.buf.flat.copy()
        else:
            flat = req.out.flat
            if flat is not req.buf.flat:
                np.copyto(flat, req.buf.flat)
        self._timed(sig, req, lambda: self._comm.broadcast(_movable(flat, sig.dtype), root=sig.root,
                                                           name=sig.name))
        if req is not None:
            result = req.out.source if req.out is not None else req.buf.wrap(flat.reshape(sig.shape))
            self._done(req, result, None)

    def _reducescatter(self, sig: Signature, req: Optional[Request]) -> None:
        if req is not None and req.buf.kind == "cuda":
            return self._reducescatter_device(sig, req)
        if req is None:
            x = np.zeros(sig.count, _STORAGE[sig.dtype])
        elif sig.dtype == _BF16 or sig.prescale != 1.0:
            x = np.empty(sig.count, _STORAGE[sig.dtype])
            _pack(x, req, sig)
        else:
            x = req.buf.flat
        out = self._timed(sig, req, lambda: np.asarray(self._comm.reducescatter(
            x.reshape(sig.shape), op=ReduceOp(sig.op), name=sig.name)))
        if req is None:
            return
        _scale(out, sig.postscale)
        if sig.dtype == _BF16:
            narrow = np.empty(out.shape, np.uint16)
            _narrow_bf16(out.reshape(-1), narrow.reshape(-1))
            out = narrow
        self._done(req, req.buf.wrap(out), None)

    def _reducescatter_device(self, sig: Signature, req: Request) -> None:
        x = req.buf.source if sig.prescale == 1.0 else req.buf.source * sig.prescale
        out = self._timed(sig, req, lambda: self._comm.reducescatter(x, op=ReduceOp(sig.op),
                                                                     name=sig.name))
        self._done(req, out if sig.postscale == 1.0 else out * sig.postscale, None)

    def _alltoall(self, sig: Signature, req: Optional[Request]) -> None:
        src = req.buf.source if req.buf.kind == "cuda" else \
            _movable(req.buf.flat, sig.dtype).reshape(req.buf.shape or (1,))
        out, recv = self._timed(sig, req, lambda: self._comm.alltoall(src, splits=req.splits,
                                                                      name=sig.name))
        if req.buf.kind != "cuda":
            out = req.buf.wrap(np.asarray(out).view(req.buf.flat.dtype))
        self._done(req, (out, recv), None)

    def _barrier(self, sig: Signature, req: Optional[Request]) -> None:
        if req is not None:  # every rank submitted it: agreement is the barrier
            self._done(req, None, None)
