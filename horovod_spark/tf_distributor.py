"""spark-tensorflow-distributor's MirroredStrategyRunner on this package's job.

    from horovod_spark import MirroredStrategyRunner  # was: from spark_tensorflow_distributor import ...
    value = MirroredStrategyRunner(num_slots=4, use_gpu=False).run(train, epochs=2)

The constructor takes spark-tensorflow-distributor's keyword arguments with its defaults and
refuses what it refuses; `run(train_fn, **kwargs)` returns the chief's value (rank 0's).
Every rank finds its workers in TF_CONFIG (`collectives.launch.frameworks`: a port each rank's
launcher reserved on the rank's address, held until it ends, where spark-tensorflow-distributor
binds port 0 and closes it again before TensorFlow takes it); with `use_custom_strategy=False`
the function runs inside `MultiWorkerMirroredStrategy().scope()`, as there.  `local_mode`
runs `num_slots` ranks on the driver (it ran one process there, and refused more than one
CPU slot).  A failure is one `JobFailedError` naming the rank, its traceback and last output.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

__all__ = ["MirroredStrategyRunner"]


class _InStrategy:
    """The function as a rank runs it: inside a MultiWorkerMirroredStrategy's scope (picklable)."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def __call__(self, **kwargs):
        __tracebackhide__ = True  # noqa: F841
        import tensorflow as tf

        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        with strategy.scope():
            return self.fn(**kwargs)


class MirroredStrategyRunner:
    """Runs a TensorFlow function as `num_slots` ranks of one MultiWorkerMirroredStrategy.

    Args:
        num_slots: GPUs (use_gpu) or CPU tasks taking part; > 0.
        local_mode: the ranks run on the driver, not as Spark tasks.
        use_gpu: a GPU per slot, from Spark's resource `gpu_resource_name` (the tasks') or
            the driver's in local mode; False hides every GPU.
        gpu_resource_name: the Spark resource name of the GPUs.
        use_custom_strategy: the function makes its own tf.distribute strategy.
        timeout, max_restarts, verbose, env: this package's, as for `TorchDistributor`.
    """

    def __init__(self, *, num_slots: int, local_mode: bool = False, use_gpu: bool = True,
                 gpu_resource_name: str = "gpu", use_custom_strategy: bool = False,
                 timeout: Optional[float] = None, max_restarts: int = 0, verbose: int = 1,
                 env: Optional[Mapping[str, str]] = None) -> None:
        from ._job import env_items, get_session, job_timeout

        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots <= 0:
            raise ValueError(f"num_slots is set to {num_slots} but cannot be less than or "
                             f"equal to 0.")
        self.num_slots, self.local_mode, self.use_gpu = num_slots, local_mode, use_gpu
        self.gpu_resource_name, self.use_custom_strategy = gpu_resource_name, use_custom_strategy
        self.timeout, self.max_restarts = job_timeout(timeout), int(max_restarts)
        self.verbose, self.env = int(verbose), env_items(env)
        self.spark = get_session(num_slots, start=not local_mode)
        self.num_tasks = None if local_mode else self.get_num_tasks()

    def get_num_tasks(self) -> int:
        """The Spark tasks to run: one per slot, or per `spark.task.resource.<gpu>.amount`
        GPUs with use_gpu (spark-tensorflow-distributor's rule)."""
        if not self.use_gpu:
            return self.num_slots
        key = f"spark.task.resource.{self.gpu_resource_name}.amount"
        conf = self.spark.sparkContext.getConf()
        if not conf.contains(key):
            raise Exception(f"Your cluster might not have Spark GPU-aware scheduling enabled, "
                            f"please contact your cluster administrator.The conf `{key}` was "
                            f"not found in the Spark configuration.")
        amount = int(float(conf.get(key)))
        if amount < 1:
            raise ValueError(f"The Spark conf `{key}` has a value of {amount} but it should "
                             f"not have a value less than 1.")
        return -(-self.num_slots // amount)

    def run(self, train_fn: Callable, **kwargs: Any) -> Any:
        """`train_fn(**kwargs)` on every rank; the chief's (rank 0's) value.

        Raises:
            JobFailedError: naming the failing rank, its error, traceback and last output.
        """
        from ._job import JobOptions, launch

        if not callable(train_fn):
            raise TypeError(f"train_fn must be a function, got {type(train_fn).__name__}")
        main = train_fn if self.use_custom_strategy else _InStrategy(train_fn)
        np_ = -self.num_slots if self.local_mode else self.num_tasks
        opts = JobOptions.of(np_, env=self.env + self._gpu_env(), timeout=self.timeout,
                             show_output=True, rank0_only=True, verbose=self.verbose,
                             max_restarts=self.max_restarts, torch_layout="tasks")
        return launch(main, (), dict(kwargs), opts)[0]

    def _gpu_env(self) -> tuple:
        if not self.use_gpu:
            return (("CUDA_VISIBLE_DEVICES", ""),)
        if self.local_mode:
            owned = self._driver_gpus()
            if self.num_slots > len(owned):
                raise ValueError(f"{self.num_slots} slots were requested for local training "
                                 f"with GPU training but only {len(owned)} GPUs were available.")
            return (("CUDA_VISIBLE_DEVICES", ",".join(owned[:self.num_slots])),)
        return ()

    def _driver_gpus(self) -> list:
        if self.spark is None:
            return []
        gpu = self.spark.sparkContext.resources.get(self.gpu_resource_name)
        return list(gpu.addresses) if gpu is not None else []
