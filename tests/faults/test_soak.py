"""Soak: 10,000 fused allreduces of random sizes and dtypes across 3 ranks, through
`horovod_spark.torch` (the fusion engine), with a small fusion threshold so that
buffers are cut, and half the tensor names keeping their signature (served by
the response cache) while the other half change every batch (negotiated).

Values are small integers, so every dtype's sum is exact whatever the order of
reduction: each result must equal numpy's bit for bit, and every rank must get
the same bits.  Then 300 float32 sums that do round must still be the same bits
on every rank, and within 1e-5 of numpy's float64 sum.  Resident memory must stay
flat (the figure is in benchmarks/RELIABILITY.md; the bound here is generous).
"""
from __future__ import annotations

import pytest

import _fault_kit as kit
import _fault_work as work

TOTAL, BATCH, SEED = 10_000, 50, 2024
RSS_BOUND = 64 << 20


@pytest.mark.slow
def test_ten_thousand_fused_allreduces_are_bit_identical_across_ranks_and_equal_numpy(fault):
    env = fault.env(HOROVOD_FUSION_THRESHOLD=256 * 1024)
    out = kit.run_local_job(work.soak, 3, args=(TOTAL, BATCH, SEED), env=env,
                            outdir=fault.outdir, timeout=300)
    assert out.error is None, out.error
    assert [r["count"] for r in out.value] == [TOTAL] * 3
    assert [r["wrong"] for r in out.value] == [0, 0, 0], "results differ from numpy"
    assert len({r["digest"] for r in out.value}) == 1, "ranks got different bits"
    growth = max(r["rss"][-1] - r["rss"][0] for r in out.value)
    assert growth < RSS_BOUND, f"a rank's RSS grew {growth >> 20} MiB over the soak"
    assert len({r["float_digest"] for r in out.value}) == 1, "rounded float32 sums differ in bits"
    assert max(r["float_worst"] for r in out.value) < 1e-5
