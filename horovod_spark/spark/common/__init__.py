"""`horovod.spark.common`'s twin: `store`, `backend` and `params` are the estimator's own
modules (`horovod_spark.estimator.store`, `.backend`, `.params`) under Horovod's names."""
