"""`horovod.spark`'s twin: `run` and `run_elastic` (with Horovod's `num_proc`), and the
estimator modules under Horovod's paths: `horovod_spark.spark.torch` (TorchEstimator,
TorchModel), `.keras` (KerasEstimator, KerasModel), `.common.store`, `.common.backend`,
`.common.params`.  Each twin is the real module under a second name, never a copy."""
from ..runner import run, run_elastic

__all__ = ["run", "run_elastic"]
