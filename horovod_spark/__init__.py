"""horovod-spark: distributed deep-learning training on Spark clusters.

    from horovod_spark import HorovodRunner
    model = HorovodRunner(np=4).run(train, epochs=3)

See `horovod_spark.runner` for the launch API; `horovod_spark.torch` and
`horovod_spark.tensorflow` for the Horovod-compatible training API.
"""
from __future__ import annotations

from collectives import __version__

from ._job import JobFailedError, NotEnoughSlotsError, ResetLimitError
from .progress import log_to_driver
from .deepspeed_distributor import DeepspeedTorchDistributor
from .distributor import TorchDistributor
from .tf_distributor import MirroredStrategyRunner
from .runner import HorovodRunner, run, run_elastic

__all__ = ["HorovodRunner", "run", "run_elastic", "TorchDistributor", "DeepspeedTorchDistributor",
           "MirroredStrategyRunner", "JobFailedError",
           "ResetLimitError", "NotEnoughSlotsError", "log_to_driver", "__version__"]
