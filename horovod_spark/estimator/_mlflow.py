"""MLflow logging of a fit, from the driver, after the ranks are done.

With mlflow installed and a run active (``mlflow.start_run()`` around ``fit``),
or ``mlflow=True`` (which starts and ends a run if none is active), a fit logs:
its params (numbers, strings and lists as they are; objects by type name), the
history's per-epoch metrics (step = the epoch, 0-based), tags (the estimator's
run_id and store, the best and the stopped epoch), and the fitted model with
MLflow's pytorch or keras flavour under ``model``.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

__all__ = ["wanted", "log_fit"]

_SKIPPED = {"model", "callbacks", "store"}  # logged otherwise, or not at all


def wanted(setting: Optional[bool]) -> bool:
    if setting is False:
        return False
    try:
        import mlflow
    except ImportError:
        if setting:
            raise ImportError("mlflow=True needs the mlflow client: pip install "
                              "'horovod-spark[mlflow]'") from None
        return False
    return bool(setting) or mlflow.active_run() is not None


def _param(value: Any) -> str:
    if value is None or isinstance(value, (bool, int, float, str)):
        return str(value)
    if isinstance(value, (list, tuple)) and all(
            isinstance(v, (bool, int, float, str)) for v in value):
        return json.dumps(list(value))
    name = getattr(value, "__name__", None) or type(value).__name__
    return name[:500]


def _params(values: Dict[str, Any]) -> Dict[str, str]:
    return {name: _param(value) for name, value in values.items()
            if name not in _SKIPPED and value is not None}


def log_fit(values: Dict[str, Any], fitted: Any, history: Dict[str, List[float]],
            flavor: str, setting: Optional[bool]) -> None:
    """Log one fit into the active run, or into a new one when ``setting`` is True."""
    import mlflow

    started = mlflow.active_run() is None
    run = mlflow.start_run() if started else mlflow.active_run()
    try:
        mlflow.log_params(_params(values))
        store = values["store"]
        mlflow.set_tags({"horovod_spark.run_id": fitted.getOrDefault("run_id"),
                         "horovod_spark.store": str(store) if store is not None else "",
                         **{f"horovod_spark.{k}": str(v[0]) for k, v in history.items()
                            if k in ("best_epoch", "stopped_epoch")}})
        epochs = {k: v for k, v in history.items() if k not in ("best_epoch", "stopped_epoch")}
        for step in range(max((len(v) for v in epochs.values()), default=0)):
            mlflow.log_metrics({k: float(v[step]) for k, v in epochs.items() if len(v) > step},
                               step=step)
        _log_model(mlflow, fitted, flavor)
    finally:
        if started:
            mlflow.end_run()
    return run.info.run_id


def _log_model(mlflow, fitted: Any, flavor: str) -> None:
    if flavor == "pytorch":
        import mlflow.pytorch
        import torch

        import inspect

        extra = {}  # newer MLflow defaults to 'pt2', a traced graph that needs an example
        if "serialization_format" in inspect.signature(mlflow.pytorch.log_model).parameters:
            extra["serialization_format"] = "pickle"
        mlflow.pytorch.log_model(fitted.getModel(), name="model",
                                 pip_requirements=[f"torch=={torch.__version__}"], **extra)
    else:
        import keras
        import mlflow.keras

        mlflow.keras.log_model(fitted.getModel(), name="model",
                               pip_requirements=[f"keras=={keras.__version__}"])
