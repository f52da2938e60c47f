"""`horovod.spark.common.backend`'s twin: the module `horovod_spark.estimator.backend` itself."""
import sys

from ...estimator import backend as _real

sys.modules[__name__] = _real
