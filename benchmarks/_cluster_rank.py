"""One rank of benchmarks/cluster.py, run inside a host of the emulated cluster.

argv: impl (ours | ours-serial | gloo | mpi), sizes in bytes (comma-separated), warmup,
reps, output directory.  ours-serial is ours with the hierarchical allreduce's phases
one after another (hier_chunk 0), for the pipeline's gain in the same run.  Each rank times an in-place float32 allreduce of every size
(each repetition starts after a barrier) and writes its times as JSON.
"""
import json
import os
import sys
import time


def _ours(serial: bool = False):
    import collectives
    from collectives.backends import native

    if serial:
        native.TUNING["hier_chunk"] = 0
    comm = collectives.init()
    return comm.rank, lambda x: comm.allreduce(x, out=x), comm.barrier, comm.close


def _gloo():
    import torch
    import torch.distributed as dist

    rank, size = int(os.environ["BENCH_RANK"]), int(os.environ["BENCH_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['BENCH_MASTER']}",
                            rank=rank, world_size=size)

    def reduce(x):
        dist.all_reduce(torch.from_numpy(x))

    return rank, reduce, dist.barrier, dist.destroy_process_group


def _mpi():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    return comm.Get_rank(), lambda x: comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM), comm.Barrier, \
        (lambda: None)


def main(impl: str, sizes: str, warmup: int, reps: int, out: str) -> None:
    import numpy as np

    rank, reduce, barrier, close = {"ours": _ours, "ours-serial": lambda: _ours(serial=True),
                                    "gloo": _gloo, "mpi": _mpi}[impl]()
    times = {}
    for nbytes in (int(s) for s in sizes.split(",")):
        x = np.ones(nbytes // 4, np.float32)
        for _ in range(warmup):
            reduce(x)
        per = []
        for _ in range(reps):
            barrier()
            t = time.perf_counter()
            reduce(x)
            per.append(time.perf_counter() - t)
        times[nbytes] = per
    barrier()
    close()
    with open(os.path.join(out, f"{impl}-rank{rank}.json"), "w") as f:
        json.dump(times, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
