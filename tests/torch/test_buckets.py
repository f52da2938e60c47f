"""Gradient buckets (horovod_spark.torch.buckets): how parameters are cut into runs and
buckets, and how a gradient becomes its bucket's view.  Training with them on real ranks
is checked in _torch_train_checks.py."""
from __future__ import annotations

import torch

from horovod_spark.torch.buckets import (BUCKET_BYTES, FIRST_BUCKET_BYTES, Bucket, make_buckets,
                                          overlap_runs)


def _params(*sizes, dtype=torch.float32):
    return [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n in sizes]


def test_overlap_runs_go_in_reverse_with_a_small_first_run():
    floats = FIRST_BUCKET_BYTES // 4
    ps = _params(BUCKET_BYTES // 4, BUCKET_BYTES // 8, BUCKET_BYTES // 8, floats // 2, floats // 2, 7)
    index = {id(p): i for i, p in enumerate(ps)}
    assert [[index[id(p)] for p in run] for run in overlap_runs(ps)] == [[5, 4, 3], [2, 1], [0]]


def test_buckets_split_runs_by_dtype_and_leave_strided_parameters_alone():
    a, b = _params(3, 4)
    c, = _params(5, dtype=torch.float64)
    t = torch.nn.Parameter(torch.zeros(2, 3).t())
    names = {a: "a", b: "b", c: "c", t: "t"}
    buckets, bucket_of, loose = make_buckets([[a, t, c, b]], names)
    assert [(bk.name, bk.flat.dtype, bk.flat.numel()) for bk in buckets] == \
        [("a..b", torch.float32, 7), ("c", torch.float64, 5)]
    assert bucket_of[a] is bucket_of[b] is buckets[0] and loose == [t]


def test_attach_copies_a_new_gradient_zeroes_a_missing_one_and_keeps_a_sparse_one_apart():
    p, q = _params(3, 2)
    bucket = Bucket("p..q", [p, q])
    bucket.flat.fill_(9.0)
    p.grad = torch.tensor([1.0, 2.0, 3.0])
    bucket.attach(p)
    bucket.attach(q)
    assert bucket.flat.tolist() == [1.0, 2.0, 3.0, 0.0, 0.0]
    assert p.grad._base is bucket.flat and q.grad._base is bucket.flat
    bucket.zero()
    assert not bucket.flat.any() and p.grad._base is bucket.flat
    p.grad = None
    sparse = torch.sparse_coo_tensor([[0]], [1.0], (3,), check_invariants=True)
    p.grad = sparse
    bucket.flat.fill_(9.0)
    bucket.attach(p)  # a sparse optimizer needs it sparse: it stays, its view is zeros
    assert p.grad is sparse and p in bucket.sparse and bucket.flat.tolist()[:3] == [0.0] * 3
    bucket.zero()
    assert p.grad is None and q.grad._base is bucket.flat
