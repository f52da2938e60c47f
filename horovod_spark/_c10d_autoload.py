"""The "hvs" torch.distributed backend registered in every rank before the job's function runs.

`init_process_group("hvs")` must work in a job's function or script without an import of
this package.  `arm()` registers the backend now where torch is imported already (a rank
forked warm), else as soon as torch's import completes (a meta-path finder that wraps
torch's loader once, then leaves), so a job that never imports torch never pays for it.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import sys

__all__ = ["arm", "Armed"]

log = logging.getLogger("horovod_spark")


def _register() -> None:
    try:
        importlib.import_module("horovod_spark.torch.c10d")
    except Exception as exc:  # a torch without torch.distributed: the job runs without "hvs"
        log.warning("horovod_spark: torch.distributed backend 'hvs' unavailable: %s", exc)


class _AfterTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _register()

        spec.loader.exec_module = exec_module
        return spec


def arm() -> None:
    """Register "hvs" now, or when torch is imported."""
    if "torch" in sys.modules:
        _register()
    elif not any(isinstance(f, _AfterTorch) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorch())


class Armed:
    """The job's function as the ranks run it: `arm()`, then the function.  Picklable when
    the function is."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self, *args, **kwargs):
        __tracebackhide__ = True  # noqa: F841 - the rank's traceback starts at the user's code
        arm()
        return self.fn(*args, **kwargs)
