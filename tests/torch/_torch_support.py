"""What the torch checks modules and their tests share.

A checks module's run_all() runs on every rank and returns {check name: "ok" or the
failure's traceback}; its test asserts each check was "ok" on every rank.
"""
from __future__ import annotations

import traceback
from typing import Callable, Iterable, Sequence


def run_checks(checks: Iterable[Callable], *args) -> dict:
    """check(*args) for each check, in order: {check name: "ok" or its traceback}."""
    results = {}
    for check in checks:
        try:
            check(*args)
            results[check.__name__] = "ok"
        except Exception:
            results[check.__name__] = traceback.format_exc()
    return results


def assert_ok(per_rank: Sequence[str]) -> None:
    """One check's result on every rank: "ok", or the ranks' tracebacks in the failure."""
    bad = [f"rank {r}:\n{text}" for r, text in enumerate(per_rank) if text != "ok"]
    assert not bad, "\n".join(bad)
