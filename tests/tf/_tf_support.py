"""Run a checks module's run_all() as real local ranks and hand back the results."""
from __future__ import annotations

import importlib.util
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))

TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_NUM_INTRAOP_THREADS": "1",
          "TF_NUM_INTEROP_THREADS": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}

requires_tf = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None
                                 or importlib.util.find_spec("keras") is None,
                                 reason="tensorflow and keras are not installed (pip install "
                                        "horovod-spark[tf])")


def run_checks(run_all, np_: int = 2, timeout: float = 240) -> dict:
    """{check: [result on rank 0, rank 1, ...]} from run_all() on np_ local ranks."""
    from collectives.launch import run_local

    per_rank = run_local(run_all, np_, env=TF_ENV, timeout=timeout)
    return {name: [res[name] for res in per_rank] for name in per_rank[0]}


def run_named(checks: dict, names=None) -> dict:
    """A checks module's run_all, on a rank: run its CHECKS (all, or those named);
    {name: "ok" or the traceback}."""
    import traceback

    results = {}
    for name, fn in checks.items():
        if names is not None and name not in names:
            continue
        try:
            fn()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    return results


def assert_ok(results: dict, name: str) -> None:
    got = results[name]
    bad = [f"rank {r}:\n{text}" for r, text in enumerate(got) if text != "ok"]
    assert not bad, "\n".join(bad)
