"""`horovod.spark.keras`'s twin: the module `horovod_spark.estimator.keras_estimator` itself."""
import sys

from ..estimator import keras_estimator as _real

sys.modules[__name__] = _real
