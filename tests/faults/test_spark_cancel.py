"""A Spark job cancelled while its ranks bootstrap leaves no shared-memory segment and no rank
process: what a notebook's stop button, a job group's cancellation or a scheduler's
preemption does (`SparkContext.cancelAllJobs`, which kills the stage's tasks).

Each trial starts a 2-rank job whose local rank 0 has created the host's named segment
while the other rank is still on its way to attach (it comes 20 s late), cancels the Spark
job at that moment, and counts what is left once the driver has raised: segments of the
job's ranks and in /dev/shm at all, and processes carrying the trial's tag.
"""
from __future__ import annotations

import os
import threading
import time

import pytest

import _default_ranks as ranks
import _fault_kit as kit

TRIALS = 20


def _segments() -> set:
    return {n for n in os.listdir("/dev/shm") if n.startswith("hvs-")}


def _trial(spark, tmp_path, trial: int) -> dict:
    fault = kit.FaultJob(tmp_path / str(trial))
    before = _segments()
    try:
        result = {}
        runner = threading.Thread(target=lambda: result.update(out=kit.run_spark_job(
            ranks.job_cancelled_while_sharing_memory, 2, args=(fault.outdir,),
            env=fault.env(), outdir=fault.outdir)))
        runner.start()
        deadline = time.monotonic() + 60
        while not kit.notes(fault.outdir, "holding") and time.monotonic() < deadline and \
                runner.is_alive():
            time.sleep(0.02)
        holding = kit.notes(fault.outdir, "holding")
        spark.sparkContext.cancelAllJobs()
        runner.join(60)
        assert not runner.is_alive(), "the cancelled job did not return within 60 s"
        out = result["out"]
        assert holding and holding[0]["shm"], f"rank 0 never held its segment: {out.output[-2000:]}"
        assert out.error is not None, out.value
        seconds, left = kit.wait_gone(fault.tag, timeout=30.0)
        return {"processes": [p.pid for p in left], "rank_segments": kit.shm_segments(out.pids()),
                "new_segments": sorted(_segments() - before), "error": type(out.error).__name__,
                "exit_s": seconds}
    finally:
        fault.cleanup()


@pytest.mark.spark
@pytest.mark.slow
def test_a_spark_job_cancelled_during_bootstrap_leaves_no_segment_20_times(spark, tmp_path):
    results = [_trial(spark, tmp_path, t) for t in range(TRIALS)]
    leaks = [(i, r) for i, r in enumerate(results)
             if r["processes"] or r["rank_segments"] or r["new_segments"]]
    assert not leaks, f"{len(leaks)} of {TRIALS} cancellations left something: {leaks}"
    assert {r["error"] for r in results} == {"JobFailedError"}, results
