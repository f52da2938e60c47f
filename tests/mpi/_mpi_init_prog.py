"""Run under mpiexec: collectives.init() picks the MPI backend, and the front end works on it.

Placement comes from MPI, not from HVS_* variables (there are none); the
Communicator's conversions (torch in, torch out; AVERAGE; async Work) run on
the MPI backend.  With argument `suite`, the shared collective suite
(tests/collectives/suite.py) runs on the same communicator.

Prints "MPI INIT OK rank r/n" (and "MPI SUITE OK") and exits 0, or prints
the failure and exits 1.
"""
from __future__ import annotations

import os
import sys
import traceback

import numpy as np

import collectives
from collectives import ReduceOp


def _check_placement(comm) -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    assert comm.backend_name == "mpi", comm.backend_name
    assert (comm.rank, comm.size) == (world.Get_rank(), world.Get_size()), (comm.rank, comm.size)
    assert (comm.local_rank, comm.local_size) == (comm.rank, comm.size)  # one machine
    assert (comm.cross_rank, comm.cross_size) == (0, 1)


def _check_front_end(comm) -> None:
    import torch

    r, n = comm.rank, comm.size
    got = comm.allreduce(torch.full((3, 2), float(r + 1)), op=ReduceOp.AVERAGE)
    assert isinstance(got, torch.Tensor) and got.shape == (3, 2), got
    assert torch.equal(got, torch.full((3, 2), (n + 1) / 2)), got
    half = comm.allreduce(torch.ones(5, dtype=torch.bfloat16) * 0.5, op=ReduceOp.SUM)
    assert half.dtype == torch.bfloat16 and torch.equal(half.float(), torch.full((5,), 0.5 * n))
    gathered = comm.allgather(np.full((r + 1, 2), r, np.int32))
    want = np.concatenate([np.full((q + 1, 2), q, np.int32) for q in range(n)])
    assert np.array_equal(gathered, want), gathered
    buf = np.arange(4.0) if r == n - 1 else np.zeros(4)
    comm.broadcast(buf, root=n - 1)
    assert np.array_equal(buf, np.arange(4.0)), buf
    works = [comm.allreduce(np.full(7, i, np.int64), async_op=True) for i in range(5)]
    for i, w in enumerate(works):
        assert np.array_equal(w.wait(timeout=60), np.full(7, i * n)), i
    comm.barrier()


def run_front_end_checks(suite: bool) -> int:
    """init() + the front-end checks (+ the shared suite); prints OK lines; 0 or 1."""
    assert "HVS_RANK" not in os.environ
    comm = collectives.init()
    status = 0
    try:
        _check_placement(comm)
        _check_front_end(comm)
        print(f"MPI INIT OK rank {comm.rank}/{comm.size}", flush=True)
        if suite:
            sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "collectives"))
            from suite import check_all

            ran = check_all(comm)
            print(f"MPI SUITE OK {ran} rank {comm.rank}/{comm.size}", flush=True)
    except Exception:  # noqa: BLE001 - report, then fail the launch
        print("FAIL front end", traceback.format_exc(), flush=True)
        status = 1
    finally:
        comm.close()
    return status


if __name__ == "__main__":
    sys.exit(run_front_end_checks("suite" in sys.argv[1:]))
