"""The suite's own layout: pytest imports test modules by basename (no packages under
tests/), so two test files with one name stop the whole run at collection."""
from __future__ import annotations

import collections
import pathlib

TESTS = pathlib.Path(__file__).resolve().parents[1]


def test_no_two_test_modules_share_a_basename():
    by_name = collections.defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if path.name.startswith(("test_", "_")) or path.name == "conftest.py":
            by_name[path.name].append(str(path.relative_to(TESTS)))
    shared = {name: paths for name, paths in by_name.items()
              if len(paths) > 1 and name != "conftest.py"}
    assert not shared, f"rename one of each: {shared}"
