"""`horovod.spark.lightning`'s twin: the module `horovod_spark.estimator.lightning_estimator`
itself (its `TorchEstimator` is `LightningEstimator`, Horovod's name for it)."""
import sys

from ..estimator import lightning_estimator as _real

sys.modules[__name__] = _real
