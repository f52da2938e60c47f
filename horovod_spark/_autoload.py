"""What every rank sets up before the job's function runs, each when its framework loads.

A job's function or script must run unchanged: `init_process_group("hvs")` without an
import of this package, a MultiWorkerMirroredStrategy that finds its workers in TF_CONFIG,
`jax.distributed.initialize()` with no arguments.  `arm()` runs each *setup* now where its
module is imported already (a rank forked warm), else as soon as the module's import
completes (a meta-path finder that wraps its loader once, then leaves), so a job that never
imports torch, TensorFlow or JAX never pays for their setup:

  torch        registers the "hvs" torch.distributed backend (`torch.c10d`)
  tensorflow   sets TF_CONFIG from the TF ports the launcher published
               (`collectives.launch.frameworks`)
  jax          registers a JAX cluster environment of the job's ranks (`horovod_spark.jax`)
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import os
import sys
from typing import Callable, Dict

__all__ = ["arm", "Armed"]

log = logging.getLogger("horovod_spark")


def _torch() -> None:
    try:
        importlib.import_module("horovod_spark.torch.c10d")
    except Exception as exc:  # a torch without torch.distributed: the job runs without "hvs"
        log.warning("horovod_spark: torch.distributed backend 'hvs' unavailable: %s", exc)


def _tensorflow() -> None:
    """TF_CONFIG for this rank, unless the job's env or the function set one."""
    if "TF_CONFIG" in os.environ or "HVS_RANK" not in os.environ:
        return
    from collectives.launch import RankEnv
    from collectives.launch.frameworks import tf_config
    from collectives.rendezvous.store import TCPStore

    renv = RankEnv.from_environ()
    store = TCPStore.connect(renv.store_addr, renv.secret, 60.0)
    try:
        value = tf_config(store, renv.job, renv.rank, renv.size, 120.0)
    finally:
        store.close()
    if value is not None:
        os.environ["TF_CONFIG"] = value


def _jax() -> None:
    if "HVS_RANK" in os.environ:
        importlib.import_module("horovod_spark.jax")


SETUPS: Dict[str, Callable[[], None]] = {"torch": _torch, "tensorflow": _tensorflow,
                                         "jax": _jax}


class _After(importlib.abc.MetaPathFinder):
    def __init__(self, name: str) -> None:
        self.name = name

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            SETUPS[name]()

        spec.loader.exec_module = exec_module
        return spec


def arm() -> None:
    """Run each setup now, or when its module is imported."""
    for name, setup in SETUPS.items():
        if name in sys.modules:
            setup()
        elif not any(isinstance(f, _After) and f.name == name for f in sys.meta_path):
            sys.meta_path.insert(0, _After(name))


class Armed:
    """The job's function as the ranks run it: `arm()`, then the function.  Picklable when
    the function is."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self, *args, **kwargs):
        __tracebackhide__ = True  # noqa: F841 - the rank's traceback starts at the user's code
        arm()
        return self.fn(*args, **kwargs)
