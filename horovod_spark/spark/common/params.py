"""`horovod.spark.common.params`'s twin: the module `horovod_spark.estimator.params` itself."""
import sys

from ...estimator import params as _real

sys.modules[__name__] = _real
