"""Run as every rank of `python -m collectives.launch -n N` on a machine with N GPUs.

Rank r uses GPU r, bootstraps NCCL through the launcher's store, and runs the
MPI backend's checker (tests/mpi/_mpi_checks.py: every op x dtype x count
against numpy, rounding of halfway float16 / bfloat16 sums) through a thin
adapter that moves each numpy buffer to the GPU and back, so both backends
answer the same questions.  Then torch CUDA tensors through the Communicator.

Prints "GPU WORLD OK rank r/n" and exits 0, or prints failures and exits 1.
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "mpi"), os.path.join(HERE, "..", "..")]

import cupy  # noqa: E402

from collectives.launch.rankenv import RankEnv
from collectives.backends.base import Topology  # noqa: E402
from collectives.backends.nccl import NcclBackend  # noqa: E402
from collectives.rendezvous.store import TCPStore


class OnDevice:
    """The Backend interface on numpy buffers, executed by NcclBackend on CuPy copies."""

    def __init__(self, nccl: NcclBackend) -> None:
        self.b, self.rank, self.size, self.topology = nccl, nccl.rank, nccl.size, nccl.topology

    def _run(self, fn, src, dst, *args) -> None:
        s = cupy.asarray(src)
        d = s if dst is src else cupy.asarray(dst)
        fn(s, d, *args)
        cupy.cuda.get_current_stream().synchronize()
        dst[...] = cupy.asnumpy(d)

    def allreduce(self, src, dst, dtype, op):
        self._run(self.b.allreduce, src, dst, dtype, op)

    def allgather(self, src, dst, dtype, counts):
        self._run(self.b.allgather, src, dst, dtype, counts)

    def reducescatter(self, src, dst, dtype, op, counts):
        self._run(self.b.reducescatter, src, dst, dtype, op, counts)

    def alltoall(self, src, send_counts, dst, recv_counts, dtype):
        self._run(lambda s, d: self.b.alltoall(s, send_counts, d, recv_counts, dtype), src, dst)

    def broadcast(self, buf, dtype, root):
        d = cupy.asarray(buf)
        self.b.broadcast(d, dtype, root)
        cupy.cuda.get_current_stream().synchronize()
        buf[...] = cupy.asnumpy(d)

    def barrier(self):
        self.b.barrier()


def _run_checks(backend) -> list:
    from _mpi_checks import COUNTS, OPS, Checker, check_rounding

    from collectives.types import DType

    c = Checker(backend)
    for dtype in DType:
        for n in COUNTS:
            for op in OPS:
                c.allreduce(dtype, op, n)
                c.reducescatter(dtype, op, min(n, 4099))
            c.allgather(dtype, n)
            c.broadcast(dtype, n)
            c.alltoall(dtype, n)
    check_rounding(c)
    return c.failures


def _torch_through_communicator(rank: int, size: int) -> None:
    import torch

    import collectives
    from collectives import ReduceOp

    comm = collectives.init()
    try:
        x = torch.full((1000,), float(rank + 1), device="cuda")
        y = comm.allreduce(x, op=ReduceOp.AVERAGE)
        assert torch.equal(y.cpu(), torch.full((1000,), (size + 1) / 2)), y[:4]
        b = torch.arange(8.0, device="cuda") * (rank == size - 1)
        comm.broadcast(b, root=size - 1)
        assert torch.equal(b.cpu(), torch.arange(8.0)), b
    finally:
        comm.close()


def main() -> int:
    env = RankEnv.from_environ()
    cupy.cuda.Device(env.local_rank).use()
    try:
        import torch

        torch.cuda.set_device(env.local_rank)
    except ImportError:
        torch = None
    store = TCPStore.connect(env.store_addr, env.secret)
    topo = Topology(env.rank, env.size, tuple([env.host] * env.size))
    nccl = NcclBackend.create(store, topo, f"{env.job}/gpu-world", device=env.local_rank)
    try:
        failures = _run_checks(OnDevice(nccl))
    finally:
        nccl.close()
    if torch is not None and not failures:
        _torch_through_communicator(env.rank, env.size)
    for f in failures:
        print("FAIL", f, flush=True)
    if not failures:
        print(f"GPU WORLD OK rank {env.rank}/{env.size}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
