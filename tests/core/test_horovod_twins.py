"""Porting from Horovod is a rename: every public module path `horovod.X` that this package
covers imports as `horovod_spark.X`, is the real module (not a copy), and has the names
Horovod's docs and examples use from it.

The list is Horovod 0.28.1's public modules that scripts import, in scope (torch,
TensorFlow, Keras, Spark, Lightning; not MXNet or Ray), every one with a twin
(`test_what_has_no_twin_is_named` keeps NO_TWIN_YET honest should one be added without).
`horovod.runner` (horovodrun's Python API, `np=` and `hosts=`) has none either:
`horovod_spark.runner` is this package's Spark runner, and `horovod_spark.run(fn,
num_proc=-N)` starts local ranks.
"""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

#: horovod.X -> (the module horovod_spark.X is, the names scripts take from it)
TWINS = {
    "horovod.torch": ("horovod_spark.torch", ["init", "allreduce", "DistributedOptimizer",
                                              "broadcast_parameters", "elastic", "Compression"]),
    "horovod.torch.elastic": ("horovod_spark.torch.elastic", ["run", "TorchState", "ObjectState"]),
    "horovod.tensorflow": ("horovod_spark.tensorflow", ["init", "allreduce",
                                                        "DistributedGradientTape",
                                                        "broadcast_variables"]),
    "horovod.tensorflow.elastic": ("horovod_spark.tensorflow.elastic",
                                   ["run", "TensorFlowKerasState"]),
    "horovod.tensorflow.keras": ("horovod_spark.keras", ["init", "DistributedOptimizer",
                                                         "callbacks", "elastic",
                                                         "broadcast_variables", "load_model"]),
    "horovod.tensorflow.keras.callbacks": ("horovod_spark.keras.callbacks",
                                           ["BroadcastGlobalVariablesCallback",
                                            "MetricAverageCallback",
                                            "LearningRateWarmupCallback",
                                            "LearningRateScheduleCallback"]),
    "horovod.tensorflow.keras.elastic": ("horovod_spark.keras.elastic",
                                         ["run", "KerasState", "CommitStateCallback",
                                          "UpdateBatchStateCallback", "UpdateEpochStateCallback"]),
    "horovod.keras": ("horovod_spark.keras", ["init", "DistributedOptimizer"]),
    "horovod.keras.callbacks": ("horovod_spark.keras.callbacks",
                                ["BroadcastGlobalVariablesCallback", "MetricAverageCallback"]),
    "horovod.keras.elastic": ("horovod_spark.keras.elastic", ["run", "KerasState"]),
    "horovod.spark": ("horovod_spark.spark", ["run", "run_elastic"]),
    "horovod.spark.torch": ("horovod_spark.estimator.torch_estimator",
                            ["TorchEstimator", "TorchModel"]),
    "horovod.spark.lightning": ("horovod_spark.estimator.lightning_estimator",
                                ["TorchEstimator", "TorchModel"]),
    "horovod.spark.keras": ("horovod_spark.estimator.keras_estimator",
                            ["KerasEstimator", "KerasModel"]),
    "horovod.spark.common": ("horovod_spark.spark.common", []),
    "horovod.spark.common.store": ("horovod_spark.estimator.store",
                                   ["Store", "LocalStore", "HDFSStore", "DBFSLocalStore"]),
    "horovod.spark.common.backend": ("horovod_spark.estimator.backend", ["SparkBackend"]),
    "horovod.spark.common.params": ("horovod_spark.estimator.params", ["EstimatorParams"]),
    "horovod.common.exceptions": ("horovod_spark.common.exceptions",
                                  ["HorovodInternalError", "HostsUpdatedInterrupt"]),
    "horovod.common.process_sets": ("horovod_spark.common.process_sets",
                                    ["ProcessSet"]),
    "horovod.common.elastic": ("horovod_spark.common.elastic", ["State", "ObjectState", "run"]),
    "horovod.common.basics": ("horovod_spark.common.basics", []),
}
NO_TWIN_YET: set = set()
TF = {name for name in TWINS if "tensorflow" in name or "keras" in name}


def _ours(horovod_name: str) -> str:
    return "horovod_spark" + horovod_name[len("horovod"):]


@pytest.mark.parametrize("horovod_name", sorted(TWINS))
def test_each_horovod_module_path_imports_as_the_real_module_with_its_names(horovod_name):
    if horovod_name in TF:
        pytest.importorskip("tensorflow")
    real_name, names = TWINS[horovod_name]
    twin = importlib.import_module(_ours(horovod_name))
    assert twin is importlib.import_module(real_name), f"{_ours(horovod_name)} is a copy"
    missing = [n for n in names if not hasattr(twin, n)]
    assert not missing, f"{_ours(horovod_name)} lacks {missing}"


def test_from_imports_and_attributes_reach_the_same_objects():
    pytest.importorskip("tensorflow")
    import horovod_spark.keras
    import horovod_spark.tensorflow.keras as hvd
    from horovod_spark.tensorflow.keras.callbacks import BroadcastGlobalVariablesCallback

    assert hvd is horovod_spark.keras
    assert hvd.callbacks.BroadcastGlobalVariablesCallback is BroadcastGlobalVariablesCallback
    assert hvd.elastic.KerasState is horovod_spark.keras.elastic.KerasState
    import horovod_spark.tensorflow

    assert horovod_spark.tensorflow.keras is hvd


def test_a_horovod_script_ports_by_renaming_its_imports(tmp_path):
    """sed s/horovod\\./horovod_spark./ on a script's import lines, in a fresh interpreter
    (each import resolves from nothing, in the order a script writes them)."""
    script = "\n".join([
        "import horovod.spark",
        "import horovod.torch as hvd",
        "from horovod.spark.common.store import LocalStore",
        "from horovod.spark.torch import TorchEstimator",
        "import horovod.spark.common.backend",
        "print(hvd.__name__, horovod.spark.run.__module__, LocalStore.__module__,",
        "      TorchEstimator.__module__)",
    ]).replace("horovod.", "horovod_spark.")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["horovod_spark.torch", "horovod_spark.runner",
                                   "horovod_spark.estimator.store",
                                   "horovod_spark.estimator.torch_estimator"]


def test_what_has_no_twin_is_named():
    for name in NO_TWIN_YET:
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(_ours(name))
