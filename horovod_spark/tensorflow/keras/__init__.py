"""`horovod.tensorflow.keras`'s twin: *is* `horovod_spark.keras` (the same module object, and
its `callbacks` and `elastic`), so a script written for Horovod's TF2 examples ports by
renaming `horovod.` to `horovod_spark.`.  Nothing is copied: this package puts the real
modules under its own names in sys.modules."""
import sys

from ... import keras as _keras
from ...keras import callbacks as _callbacks
from ...keras import elastic as _elastic

sys.modules[__name__ + ".callbacks"] = _callbacks
sys.modules[__name__ + ".elastic"] = _elastic
sys.modules[__name__] = _keras
