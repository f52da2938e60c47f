"""Spark ML estimators: TorchEstimator, KerasEstimator, their Models, and the Store.

The estimators train on the DataFrame's own partitions, one rank per partition,
in one barrier stage; see ``data.py`` for the data path and ``_launch.py`` for
how the stage composes with the Spark runner.  Frameworks are imported lazily:
``import horovod_spark.estimator`` needs neither torch nor tensorflow.
"""
from __future__ import annotations

from typing import Any

from horovod_spark.estimator.store import FilesystemStore, LocalStore, Store

__all__ = ["TorchEstimator", "TorchModel", "KerasEstimator", "KerasModel",
           "Store", "LocalStore", "FilesystemStore"]

_LAZY = {"TorchEstimator": "torch_estimator", "TorchModel": "torch_estimator",
         "KerasEstimator": "keras_estimator", "KerasModel": "keras_estimator"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module = importlib.import_module(f"horovod_spark.estimator.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'horovod_spark.estimator' has no attribute {name!r}")
