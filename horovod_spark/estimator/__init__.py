"""Spark ML estimators: TorchEstimator, LightningEstimator (a LightningModule),
KerasEstimator, their Models, and the Store.

    from horovod_spark.estimator import TorchEstimator
    est = TorchEstimator(num_proc=2, model=net, optimizer=torch.optim.Adam(net.parameters()),
                         loss=torch.nn.CrossEntropyLoss(), feature_cols=["features"],
                         label_cols=["label"], batch_size=64, epochs=5, validation=0.1,
                         store="hdfs://nn/user/me/runs", run_id="digits")
    model = est.fit(df)                       # or Pipeline([..., est]).fit(df)
    model.getHistory()                        # {"loss": [...], "val_loss": [...], ...}
    model.transform(test_df)                  # adds "label__output"
    model.write().overwrite().save(path)      # TorchModel.load(path)

How a fit runs: the driver checks the columns and dry-runs the model on a few
rows (clear errors before anything starts); the DataFrame is repartitioned to
``num_proc`` partitions if it has another number; one barrier ``mapInArrow``
stage hands each partition to one rank: the task spills it to a local Arrow
file, the tasks agree on row counts (and on any bad row), and each task runs its
rank through the Spark runner's task machinery; the rank memory-maps its file,
so data larger than memory trains.  Every rank runs the same number of steps
per epoch however uneven the partitions; rank 0 checkpoints every epoch to the
Store, and a fit with the same ``run_id`` resumes.  Nothing of the data set goes
through the Store.

Notes:
- the model, optimizer, loss, metrics and ``transformation_fn`` are cloudpickled
  to the ranks: what they reference must be importable there, or defined in
  ``__main__``, or registered with ``cloudpickle.register_pickle_by_value``;
- ``transformation_fn`` applies to training and validation batches only, not to
  ``Model.transform``;
- model files (``model.bin``) hold pickles: load only models you trust, as with
  ``torch.load``; checkpoints hold none (torch state dicts read with
  ``weights_only=True``, Keras weights in ``.npz``).

Frameworks are imported lazily: ``import horovod_spark.estimator`` needs neither
torch nor tensorflow.
"""
from __future__ import annotations

from typing import Any

from horovod_spark.estimator.backend import SparkBackend
from horovod_spark.estimator.store import (DBFSLocalStore, FilesystemStore, HDFSStore, LocalStore,
                                           Store)
from horovod_spark.estimator.trainer import EarlyStopping

__all__ = ["TorchEstimator", "TorchModel", "LightningEstimator", "KerasEstimator", "KerasModel",
           "Store", "LocalStore", "FilesystemStore", "DBFSLocalStore", "HDFSStore",
           "EarlyStopping", "SparkBackend"]

_LAZY = {"TorchEstimator": "torch_estimator", "TorchModel": "torch_estimator",
         "LightningEstimator": "lightning_estimator",
         "KerasEstimator": "keras_estimator", "KerasModel": "keras_estimator"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module = importlib.import_module(f"horovod_spark.estimator.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'horovod_spark.estimator' has no attribute {name!r}")
