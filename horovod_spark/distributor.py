"""pyspark's TorchDistributor on this package's job: change the import line, keep the rest.

    from horovod_spark import TorchDistributor  # was: from pyspark.ml.torch.distributor import ...
    model = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(train, 1e-3)
    TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run("train.py", "--lr=1e-3")

The constructor takes pyspark's arguments with its defaults, and refuses what pyspark's
refuses with the same errors; `run` returns what pyspark's returns (rank 0's value for a
function, None for a script).  Every rank has torchrun's environment
(`collectives.launch.torchrun`) in place of a torchrun process: on a cluster each rank is a
node of one process with its task's own GPU, as under pyspark's; in local mode the ranks
are the processes of one node on the driver.  The job is the runner's: each rank's output
live on the driver, a failure as one `JobFailedError` (a RuntimeError, as pyspark's) naming
the rank, its traceback and its last output, nothing left running; and, keyword-only,
`timeout`, `max_restarts`, `verbose` and `env`.
"""
from __future__ import annotations

import logging
import textwrap
from typing import Any, Callable, Mapping, Optional, Union

from .script import script_main

__all__ = ["TorchDistributor"]

log = logging.getLogger(__name__)

_TORCH_SSL_CONF = "pytorch.spark.distributor.ignoreSsl"


def _conf(spark, key: str, default: str) -> str:
    """A setting of the session `spark`, as pyspark's reads it (the session's runtime conf);
    None, a local-mode job with no session: the default."""
    return default if spark is None else str(spark.conf.get(key, default))


def _ssl_refusal(name: str, conf_key: str) -> str:
    return textwrap.dedent(f"""
        This cluster has TLS encryption enabled;
        however, {name} does not support
        data encryption in transit. To override
        this configuration and use {name}
        anyway, you may set '{conf_key}'
        to 'true' in the Spark configuration. Please note this
        will cause model parameters and possibly training
        data to be sent between nodes unencrypted.
        """)


class TorchDistributor:
    """Runs a torch.distributed function or script as `num_processes` ranks.

    Args:
        num_processes: ranks (pyspark's meaning: Spark tasks with `local_mode=False`,
            processes on the driver with `local_mode=True`).
        local_mode: run the ranks on the driver, not as Spark tasks.
        use_gpu: one GPU per rank (from the task's, or the driver's, Spark resources);
            False hides every GPU from the ranks, as pyspark's does.
        timeout: seconds the whole job may run (None: no limit).
        max_restarts: rerun every rank up to this many times after a failure
            (TORCHELASTIC_RESTART_COUNT says which attempt a rank is in).
        verbose: 0 hides the progress bar.
        env: variables added to every rank's environment.
    """

    def __init__(self, num_processes: int = 1, local_mode: bool = True, use_gpu: bool = True,
                 _ssl_conf: str = _TORCH_SSL_CONF, *, timeout: Optional[float] = None,
                 max_restarts: int = 0, verbose: int = 1,
                 env: Optional[Mapping[str, str]] = None) -> None:
        from ._job import env_items, get_session, job_timeout

        # local mode needs no Spark: only an active session's settings are read then
        self.spark = get_session(num_processes if isinstance(num_processes, int) else 0,
                                 start=not local_mode)
        self.num_processes, self.local_mode, self.use_gpu = num_processes, local_mode, use_gpu
        self.ssl_conf = _ssl_conf
        self.num_tasks = self._get_num_tasks()
        if not isinstance(num_processes, int) or num_processes <= 0:
            raise ValueError("num_processes has to be a positive integer")
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
        self.timeout, self.max_restarts = job_timeout(timeout), max_restarts
        self.verbose, self.env = int(verbose), env_items(env)

    def _get_num_tasks(self) -> int:
        """pyspark's checks of the GPU settings, with its errors; the tasks to run."""
        if not self.use_gpu:
            return self.num_processes
        if not self.local_mode:
            key = "spark.task.resource.gpu.amount"
            amount = int(float(_conf(self.spark, key, "0")))
            if amount < 1:
                raise RuntimeError(f"'{key}' was unset, so gpu usage is unavailable.")
            if amount > 1:
                raise RuntimeError(f"'{key}' is {amount}: TorchDistributor of horovod_spark runs "
                                   f"one rank per task, with one GPU each; set {key}=1 and "
                                   f"num_processes to the number of GPUs")
            return self.num_processes
        if not self._driver_gpus():
            raise RuntimeError("GPUs were unable to be found on the driver.")
        available = int(_conf(self.spark, "spark.driver.resource.gpu.amount", "0"))
        if available == 0:
            raise RuntimeError("GPU resources were not configured properly on the driver.")
        if self.num_processes > available:
            log.warning("'num_processes' cannot be set to a value greater than the number of "
                        "available GPUs on the driver, which is %d. 'num_processes' was reset "
                        "to be equal to the number of available GPUs.", available)
            self.num_processes = available
        return self.num_processes

    def _driver_gpus(self) -> list:
        """The GPU addresses the driver owns (Spark's resources; a Connect client's own)."""
        from ._job import is_connect

        if self.spark is None:
            return []
        resources = self.spark._client._resources() if is_connect(self.spark) else \
            self.spark.sparkContext.resources
        gpu = resources.get("gpu")
        return list(gpu.addresses) if gpu is not None else []

    def _check_encryption(self) -> None:
        if _conf(self.spark, "spark.ssl.enabled", "false").lower() != "true":
            return
        name = type(self).__name__
        if _conf(self.spark, self.ssl_conf, "false").lower() != "true":
            raise RuntimeError(_ssl_refusal(name, self.ssl_conf))
        log.warning("This cluster has TLS encryption enabled; however, %s does not support data "
                    "encryption in transit. '%s' is 'true', so %s runs anyway: model parameters "
                    "and possibly training data cross the network unencrypted.", name,
                    self.ssl_conf, name)

    def run(self, train_object: Union[Callable, str], *args: Any, **kwargs: Any) -> Optional[Any]:
        """Run `train_object(*args, **kwargs)`, or the script `train_object` with `args` as its
        command line, as every rank; returns rank 0's value (None for a script).

        Raises:
            JobFailedError: naming the failing rank, its error, traceback and last output.
        """
        self._check_encryption()
        if isinstance(train_object, str):
            if kwargs:
                raise ValueError("Running pytorch file does not support key-word type arguments.")
            main, args = script_main(train_object, [str(a) for a in args]), ()
        elif callable(train_object):
            main = train_object
        else:
            raise TypeError(f"train_object must be a function or the path of a Python script, "
                            f"got {type(train_object).__name__}")
        value = self._launch(main, args, kwargs)
        return None if isinstance(train_object, str) else value

    def _launch(self, main: Callable, args: tuple, kwargs: dict):
        from ._job import JobOptions, launch

        np_ = -self.num_processes if self.local_mode else self.num_tasks
        opts = JobOptions.of(np_, env=self.env + self._gpu_env(), timeout=self.timeout,
                             show_output=True, rank0_only=True, verbose=self.verbose,
                             max_restarts=self.max_restarts,
                             torch_layout="hosts" if self.local_mode else "tasks")
        return launch(main, args, kwargs, opts)[0]

    def _gpu_env(self) -> tuple:
        """pyspark's GPU visibility: none without use_gpu; in local mode, the driver's first
        num_processes GPUs (a Spark task's own come from its resources)."""
        if not self.use_gpu:
            return (("CUDA_VISIBLE_DEVICES", ""),)
        if self.local_mode:
            return (("CUDA_VISIBLE_DEVICES", ",".join(self._driver_gpus()[:self.num_processes])),)
        return ()
