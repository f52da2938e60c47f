"""Run under mpiexec -n 3: Horovod's process sets on the MPI backend (torch adapter).

Sets given as world ranks ([0, 2]), from an mpi4py communicator every rank holds ([1, 2]),
and from COMM_WORLD.Split (Horovod's example: each rank passes its own half, and the halves
are registered as two sets) reduce and gather among their members only, beside the world's
ops; a rank outside a set is refused.  Prints "MPI PSETS OK" on each rank that passed.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))


def main() -> int:
    import torch
    from mpi4py import MPI

    import horovod_spark.torch as hvd

    world = MPI.COMM_WORLD
    # a communicator every rank holds, whose group is ranks 1 and 2 (Create on the world)
    group = world.Get_group().Incl([1, 2])
    last = world.Create(group)
    group.Free()
    ends = hvd.ProcessSet([0, 2])
    pair = hvd.ProcessSet(last) if last != MPI.COMM_NULL else hvd.ProcessSet([1, 2])
    half = hvd.ProcessSet(world.Split(world.Get_rank() % 2, world.Get_rank()))
    hvd.init(process_sets=[ends, pair, half])
    rank = hvd.rank()
    assert hvd.size() == 3 and hvd.mpi_enabled()
    x = torch.full((5,), float(rank + 1))
    if ends.included():
        got = hvd.allreduce(x, op=hvd.Sum, process_set=ends, name="ends")
        assert got.tolist() == [4.0] * 5, got  # ranks 0 and 2: 1 + 3
        assert ends.rank() == [0, 2].index(rank) and ends.size() == 2
    else:
        try:
            hvd.allreduce(x, process_set=ends, name="ends")
        except ValueError as exc:
            assert "not" in str(exc) and "process set" in str(exc).lower(), exc
        else:
            raise AssertionError("rank 1 ran an op on a set it is not in")
    assert pair.ranks == [1, 2], pair.ranks
    if pair.included():
        got = hvd.allreduce(x, op=hvd.Sum, process_set=pair, name="pair")
        assert got.tolist() == [5.0] * 5, got  # ranks 1 and 2: 2 + 3
        gathered = hvd.allgather(torch.tensor([rank]), process_set=pair, name="gather")
        assert gathered.tolist() == [1, 2], gathered
    members = [0, 2] if rank % 2 == 0 else [1]
    assert half.ranks == members and half.included(), half.ranks
    # ids in Horovod's order: [0, 2] is the set already registered first (1); the odd half
    # is a new one after [1, 2] (2)
    assert half.process_set_id == (ends.process_set_id if rank % 2 == 0 else 3), \
        (half.process_set_id, ends.process_set_id)
    got = hvd.allreduce(x, op=hvd.Sum, process_set=half, name="half")
    assert got.tolist() == [float(sum(m + 1 for m in members))] * 5, got
    world_sum = hvd.allreduce(x, op=hvd.Sum, name="world")
    assert world_sum.tolist() == [6.0] * 5, world_sum
    hvd.shutdown()
    print(f"MPI PSETS OK {rank}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
