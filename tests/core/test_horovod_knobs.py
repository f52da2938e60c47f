"""Horovod's variables: each honoured with Horovod's meaning, or warned of once on the driver.

The names are Horovod 0.28's documented run-time variables (its docs' "environment
variables" of tensor fusion, the timeline, autotune, stall checks, logging, the process
sets, elastic, Gloo, oneCCL and the GPU operations), retyped here so the test fails when
a name falls out of the tables.
"""
from __future__ import annotations

import json
import logging
import os
import re
import warnings
from pathlib import Path

import pytest

import collectives
from collectives.launch import run_local
from collectives.settings import Config
from horovod_spark import settings as hs

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)

HOROVOD_0_28 = """
HOROVOD_FUSION_THRESHOLD HOROVOD_CYCLE_TIME HOROVOD_CACHE_CAPACITY HOROVOD_TIMELINE
HOROVOD_TIMELINE_MARK_CYCLES HOROVOD_AUTOTUNE HOROVOD_AUTOTUNE_LOG
HOROVOD_AUTOTUNE_WARMUP_SAMPLES HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE
HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE
HOROVOD_HIERARCHICAL_ALLREDUCE HOROVOD_HIERARCHICAL_ALLGATHER HOROVOD_STALL_CHECK_DISABLE
HOROVOD_STALL_CHECK_TIME_SECONDS HOROVOD_STALL_SHUTDOWN_TIME_SECONDS HOROVOD_LOG_LEVEL
HOROVOD_LOG_HIDE_TIME HOROVOD_MPI_THREADS_DISABLE HOROVOD_NUM_NCCL_STREAMS
HOROVOD_BATCH_D2D_MEMCOPIES HOROVOD_CPU_OPERATIONS HOROVOD_GPU_OPERATIONS HOROVOD_CONTROLLER
HOROVOD_CCL_CACHE HOROVOD_GLOO_IFACE HOROVOD_GLOO_TIMEOUT_SECONDS HOROVOD_ADASUM_MPI_CHUNK_SIZE
HOROVOD_THREAD_AFFINITY HOROVOD_DISABLE_GROUP_FUSION HOROVOD_DISABLE_NVTX_RANGES
HOROVOD_ENABLE_ASYNC_COMPLETION HOROVOD_DYNAMIC_PROCESS_SETS HOROVOD_ENABLE_XLA_OPS
HOROVOD_ELASTIC_TIMEOUT HOROVOD_HOSTNAME HOROVOD_GPU_ALLREDUCE HOROVOD_GPU_ALLGATHER
HOROVOD_GPU_BROADCAST HOROVOD_GPU_ALLTOALL
""".split()


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(hs, "_warned", set())


def _said(env: dict) -> list:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hs.DriverSettings.read(job_env=env, environ={})
    return [str(w.message) for w in caught]


def test_every_horovod_variable_has_a_row_and_the_docs_table_is_the_code_s():
    rows = {name for name, _, _ in hs.horovod_rows()}
    assert set(HOROVOD_0_28) <= rows, sorted(set(HOROVOD_0_28) - rows)
    text = (ROOT / "docs" / "configuration.md").read_text()
    section = text[text.index("## Horovod's variables"):]
    documented = set(re.findall(r"^\| `(HOROVOD_[A-Z0-9_]+)` \|", section, re.M))
    assert documented == {k.name for k in hs.HOROVOD}
    absent = [name for name in HOROVOD_0_28 if f"`{name}`" not in text]
    assert not absent, absent


@pytest.mark.parametrize("knob", hs.HOROVOD, ids=lambda k: k.name)
def test_a_variable_not_honoured_is_warned_of_once_naming_what_to_do(knob):
    said = _said({knob.name: "7"})
    assert len(said) == 1 and knob.name in said[0] and knob.here in said[0], said
    assert _said({knob.name: "7"}) == []  # once
    for value in knob.honoured:  # what this package does anyway: nothing to say
        assert _said({knob.name: value}) == []


def test_values_mapped_and_names_of_nobody_are_said_once():
    said = _said({"HOROVOD_CACHE_CAPACITY": "0", "HOROVOD_CPU_OPERATIONS": "gloo",
                  "HOROVOD_FUSION_THRESHOLD": "1048576", "HOROVOD_CYCLE_TIMES": "2",
                  "HOROVOD_WITH_PYTORCH": "1", "HOROVOD_RANK": "3"})
    assert len(said) == 4, said
    assert any("HOROVOD_CACHE_CAPACITY=0" in s and "keeps 1" in s for s in said)
    assert any("HOROVOD_CPU_OPERATIONS=gloo" in s and "native transport" in s for s in said)
    assert any("HOROVOD_CYCLE_TIMES" in s and "did you mean HOROVOD_CYCLE_TIME?" in s for s in said)
    assert any("HOROVOD_WITH_PYTORCH" in s and "build switches" in s for s in said)


def test_cpu_operations_mpi_is_the_mpi_backend_unless_the_backend_is_named():
    assert Config.create(env={"HOROVOD_CPU_OPERATIONS": "mpi"}).backend == "mpi"
    assert Config.create(env={"HOROVOD_CPU_OPERATIONS": "gloo"}).backend == "auto"
    assert Config.create(env={"HOROVOD_CPU_OPERATIONS": "mpi",
                              "HOROVOD_SPARK_BACKEND": "native"}).backend == "native"
    with pytest.raises(ValueError, match="HOROVOD_CPU_OPERATIONS"):
        hs.DriverSettings.read(job_env={"HOROVOD_CPU_OPERATIONS": "nccl"}, environ={})


def test_log_hide_time_drops_the_time_stamp(monkeypatch):
    from collectives.logs import apply_log_level

    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    name = "hvs-test-hide-time"
    for hide, stamped in ((True, False), (False, True)):
        apply_log_level("INFO", 1, 2, (name,), hide_time=hide)
        (handler,) = logging.getLogger(name).handlers
        record = logging.LogRecord(name, logging.INFO, __file__, 1, "hello", (), None)
        text = handler.format(record)
        assert text.endswith("hello") and "hvs rank 1/2" in text
        assert bool(re.match(r"\[\d{4}-\d\d-\d\d ", text)) == stamped, text
    logging.getLogger(name).handlers.clear()


def knobs_on_a_rank(workdir: str) -> dict:
    """Run on each rank with the knobs in its environment: what the engine made of them."""
    import numpy as np

    from collectives.fusion.engine import FusionEngine

    comm = collectives.init()
    eng = FusionEngine(comm)
    try:
        capacity = eng._cache.capacity
        outs = [eng.submit(f"knob.{i}", "allreduce", np.full(4, i, np.float32)).wait(30)
                for i in range(6)]
        outs += [eng.submit(f"knob.{i}", "allreduce", np.full(4, i, np.float32)).wait(30)
                 for i in range(6)]
        bits = len(eng._cache)
        stall_due = eng._stall.due({"x": object()})
    finally:
        eng.shutdown()
        comm.close()
    return {"capacity": capacity, "bits": bits, "stall_due": stall_due,
            "right": all(float(o[0]) == 2 * (i % 6) for i, o in enumerate(outs))}


def test_the_ranks_take_the_cache_capacity_the_cycle_marks_and_the_stall_switch(tmp_path):
    timeline = tmp_path / "timeline.json"
    env = {"HOROVOD_CACHE_CAPACITY": "2", "HOROVOD_TIMELINE": str(timeline),
           "HOROVOD_TIMELINE_MARK_CYCLES": "1", "HOROVOD_STALL_CHECK_DISABLE": "1",
           "HOROVOD_SPARK_TORCH_LANE": "0"}
    results = run_local(knobs_on_a_rank, 2, args=(str(tmp_path),), env=env, timeout=90)
    for r in results:
        assert r == {"capacity": 2, "bits": 2, "stall_due": False, "right": True}, results
    events = json.loads(timeline.read_text())
    assert any(e.get("name") == "CYCLE_START" and e.get("ph") == "i" for e in events)
