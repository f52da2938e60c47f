"""`horovod.spark.torch`'s twin: the module `horovod_spark.estimator.torch_estimator` itself."""
import sys

from ..estimator import torch_estimator as _real

sys.modules[__name__] = _real
