"""`horovod.spark.common.store`'s twin: the module `horovod_spark.estimator.store` itself."""
import sys

from ...estimator import store as _real

sys.modules[__name__] = _real
