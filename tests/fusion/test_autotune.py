"""HOROVOD_AUTOTUNE on real ranks: every rank applies rank 0's choice in the same cycle, the
results stay right while the setting changes under them, and the log is Horovod's CSV."""
from __future__ import annotations

import csv

import numpy as np
import pytest

from collectives.fusion.autotune import CYCLE_TIMES_MS, LOG_HEADER, THRESHOLDS_MIB, _Search
from collectives.launch import run_local

pytestmark = pytest.mark.timeout(180)
#: Steps each rank runs: tuning below ends after 7 settings of 5 samples of 4 steps (a
#: sample ends when a tensor has been reduced more than 3 times): 140 steps, then tuned.
STEPS = 170


def test_the_search_finds_the_peak_of_a_smooth_score():
    peak = (4.0, 2.5)
    search = _Search(max_samples=20, noise=0.1, first=(64.0, 1.0))

    def score(point):
        t = np.log2(point[0] + 0.125) - np.log2(peak[0] + 0.125)
        c = np.log2(point[1] + 0.25) - np.log2(peak[1] + 0.25)
        return 100.0 - 10 * t * t - 10 * c * c

    while not search.done():
        point = search.next()
        assert point[0] in THRESHOLDS_MIB + (64.0,) and point[1] in CYCLE_TIMES_MS
        search.add(point, score(point))
    tried = [p for p, _ in search.tried]
    assert len(set(tried)) == len(tried), "a point was tried twice"
    assert search.best()[0] == peak, search.tried


def tuned_rank(log_path: str) -> dict:
    import collectives
    from collectives.fusion.engine import FusionEngine

    comm = collectives.init()
    eng = FusionEngine(comm)
    right = True
    try:
        for step in range(STEPS):
            xs = [np.full(256, comm.rank + i, np.float32) for i in range(8)]
            handles = [eng.submit(f"grad.{i}", "allreduce", x, out=x) for i, x in enumerate(xs)]
            for i, h in enumerate(handles):
                h.wait(30)
                right = right and bool((xs[i] == 2 * i + 1).all())
        return {"active": eng._tuner.active, "point": eng._tuner.point,
                "threshold": eng._executor.threshold, "changes": eng._tuner.history, "right": right,
                "samples": eng._tuner.samples}
    finally:
        eng.shutdown()
        comm.close()


def test_every_rank_applies_rank_0s_setting_in_the_same_cycle_and_the_log_is_horovods(tmp_path):
    log = tmp_path / "autotune.csv"
    env = {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": str(log),
           "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "3",
           "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "6", "HOROVOD_SPARK_TORCH_LANE": "0"}
    results = run_local(tuned_rank, 2, args=(str(log),), env=env, timeout=150)
    a, b = results
    assert a["right"] and b["right"]
    assert not a["active"] and not b["active"], results  # tuning ended
    assert a["changes"] == b["changes"], "the ranks changed settings at different cycles"
    assert a["point"] == b["point"] and a["threshold"] == int(a["point"][0] * (1 << 20))
    assert a["samples"] == b["samples"] == 1 + 6  # the warm-up, then the scored ones
    assert len({p for _, p in a["changes"]}) > 2  # it did move through settings
    with open(log) as f:
        rows = list(csv.reader(f))
    assert ",".join(rows[0]) == LOG_HEADER
    body = rows[1:]
    assert len(body) == 6 + 1  # each scored sample, then the best
    scores = [float(r[4]) for r in body[:-1]]
    assert float(body[-1][4]) == max(scores) and all(s > 0 for s in scores)
    assert (float(body[-1][3]), float(body[-1][2])) == a["point"]
