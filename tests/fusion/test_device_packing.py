"""The device fusion path (pack into one buffer, one allreduce, unpack with the scale factors),
run on two real ranks without a GPU: CPU torch tensors, whose flat views are numpy arrays
(CuPy's spelling), through the executor; and the torch spelling of the helpers on CPU tensors."""
from __future__ import annotations

import numpy as np
import pytest

from collectives.launch import run_local


def _rank_main():
    import torch

    import collectives
    from collectives.fusion.executor import Executor
    from collectives.fusion.request import make_request
    from collectives.types import ReduceOp

    comm = collectives.init()
    r, n = comm.rank, comm.size
    done = lambda req, result, err: req.handle._finish(result, err)  # noqa: E731
    ex = Executor(comm, 64 << 20, None, dict.fromkeys(("allreduce_tensors", "allreduce_bytes",
                                                       "collectives", "collective_s",
                                                       "fused_buffers"), 0), done)
    shapes = [(3, 4), (7,), (2, 2, 2), (1,)]
    xs = [torch.arange(int(np.prod(s)), dtype=torch.float32).reshape(s) + 10 * r for s in shapes]
    outs = [None, xs[1], torch.empty(shapes[2]), None]  # new, in place, another tensor, new
    ops = [ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.SUM]
    scales = [(1.0, 1.0), (1.0, 1.0), (2.0, 0.5), (1.0, 3.0)]
    originals = [x.clone() for x in xs]
    reqs = [make_request(f"t{i}", "allreduce", x, out, op, pre, post, 0, None, None, r, n)
            for i, (x, out, op, (pre, post)) in enumerate(zip(xs, outs, ops, scales))]
    group = [(q.sig, q) for q in reqs]
    for _ in range(2):  # the second pass reuses the buffer
        for x, o in zip(xs, originals):
            x.copy_(o)
        ex._allreduce_device_group(group, ReduceOp.SUM)
        results = [q.handle.wait(10) for q in reqs]
    comm.close()
    return [np.asarray(t).tolist() for t in results], [tuple(t.shape) for t in results], \
        results[1] is xs[1], results[2] is outs[2], any(isinstance(k, tuple) for k in ex._buffers)


@pytest.mark.timeout(120)
def test_a_group_packed_in_one_device_style_buffer_reduces_like_numpy():
    per_rank = run_local(_rank_main, 2, timeout=100, env={"OMP_NUM_THREADS": "1"})
    shapes = [(3, 4), (7,), (2, 2, 2), (1,)]
    base = [np.arange(int(np.prod(s)), dtype=np.float32).reshape(s) for s in shapes]
    summed = [b * 2 + 10 for b in base]  # ranks add 0 and 10
    want = [summed[0], summed[1] / 2, 2.0 * summed[2] * 0.5, summed[3] * 3.0]
    for values, got_shapes, in_place, into_out, kept in per_rank:
        assert got_shapes == shapes and in_place and into_out and kept
        for got, w in zip(values, want):
            np.testing.assert_allclose(np.array(got), w, rtol=1e-6)


def test_the_torch_spelling_of_the_device_helpers_packs_and_clones():
    import torch

    from collectives.fusion._device import clone, concat, empty_like, is_torch

    parts = [torch.arange(3.0), torch.full((2,), 7.0)]
    buf = empty_like(parts[0], 8)
    assert is_torch(buf) and buf.shape == (8,) and buf.dtype == torch.float32
    concat(parts, buf[:5])
    copy = clone(buf[:5])
    buf[:5] *= 0
    assert copy.tolist() == [0.0, 1.0, 2.0, 7.0, 7.0] and not is_torch(np.zeros(1))
