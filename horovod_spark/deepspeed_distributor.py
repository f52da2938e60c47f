"""pyspark's DeepspeedTorchDistributor on this package's job.

    from horovod_spark import DeepspeedTorchDistributor  # was: from pyspark.ml.deepspeed...
    DeepspeedTorchDistributor(numGpus=2, nnodes=1, localMode=True, useGpu=False,
                              deepspeedConfig={"train_batch_size": 8}).run("train.py", "--lr=1")

numGpus x nnodes ranks, each with torchrun's environment, which `deepspeed.initialize` and
`deepspeed.init_distributed` read (no pdsh, no hostfile, no `deepspeed` launcher).  As
pyspark's, a script gets `--deepspeed` and, where a config is given, `--deepspeed_config
PATH` after its own arguments.  The config (a dict, or a JSON file read on the driver)
travels with the job and each rank writes it to a file of its own, so a cluster's executors
need not see the driver's files (pyspark passes the driver's temporary path).  A function
finds the same file at HOROVOD_SPARK_DEEPSPEED_CONFIG, for
`deepspeed.initialize(config=os.environ["HOROVOD_SPARK_DEEPSPEED_CONFIG"], ...)`.
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Callable, Dict, Optional, Union

from .distributor import TorchDistributor
from .script import ScriptMain, script_main
from .settings import DEEPSPEED_CONFIG

__all__ = ["DeepspeedTorchDistributor"]

_DEEPSPEED_SSL_CONF = "deepspeed.spark.distributor.ignoreSsl"
CONFIG_VAR = DEEPSPEED_CONFIG.name


class _WithConfig:
    """A rank's main with the job's DeepSpeed config in a file of its own (picklable): a
    script gets `--deepspeed [--deepspeed_config PATH]` after its arguments, a function the
    path in CONFIG_VAR."""

    def __init__(self, main: Callable, config: Optional[str]) -> None:
        self.main, self.config = main, config

    def __call__(self, *args, **kwargs):
        __tracebackhide__ = True  # noqa: F841
        path = None
        if self.config is not None:
            fd, path = tempfile.mkstemp(prefix="deepspeed-config-", suffix=".json")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(self.config)
            os.environ[CONFIG_VAR] = path
        try:
            if isinstance(self.main, ScriptMain):
                extra = ["--deepspeed"] + (["--deepspeed_config", path] if path else [])
                return ScriptMain(self.main.path, self.main.source, self.main.argv + extra)()
            return self.main(*args, **kwargs)
        finally:
            if path is not None:
                os.unlink(path)


def _config_text(config: Union[None, str, Dict[str, Any]]) -> Optional[str]:
    """The config as JSON text: a dict's, or a file's (read here, on the driver)."""
    if config is None or config == "":
        return None
    if isinstance(config, dict):
        return json.dumps(config)
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(f"deepspeedConfig must be a dict, the path of a JSON file or None, got "
                        f"{type(config).__name__}")
    try:
        with open(config, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"deepspeedConfig {str(config)!r} cannot be read on the driver: "
                         f"{exc}") from None
    try:
        json.loads(text)
    except ValueError as exc:
        raise ValueError(f"deepspeedConfig {str(config)!r} is not JSON: {exc}") from None
    return text


class DeepspeedTorchDistributor(TorchDistributor):
    """Runs a DeepSpeed function or script as numGpus x nnodes ranks.

    Args:
        numGpus: ranks per node (GPUs with useGpu).
        nnodes: nodes: Spark tasks take the place of nodes, so there are numGpus x nnodes
            ranks, each with one GPU where useGpu.
        localMode: run the ranks on the driver, not as Spark tasks.
        useGpu: one GPU per rank; False hides every GPU (DeepSpeed then takes its CPU
            accelerator, and gloo).
        deepspeedConfig: a dict, the path of a JSON file on the driver, or None.
        timeout, max_restarts, verbose, env: this package's, as for `TorchDistributor`.
    """

    def __init__(self, numGpus: int = 1, nnodes: int = 1, localMode: bool = True,
                 useGpu: bool = True, deepspeedConfig: Union[None, str, Dict[str, Any]] = None,
                 *, timeout: Optional[float] = None, max_restarts: int = 0, verbose: int = 1,
                 env: Optional[Dict[str, str]] = None) -> None:
        for name, value in (("numGpus", numGpus), ("nnodes", nnodes)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} has to be a positive integer, got {value!r}")
        self.deepspeed_config = deepspeedConfig
        self._config = _config_text(deepspeedConfig)
        super().__init__(numGpus * nnodes, localMode, useGpu, _ssl_conf=_DEEPSPEED_SSL_CONF,
                         timeout=timeout, max_restarts=max_restarts, verbose=verbose, env=env)

    def run(self, train_object: Union[Callable, str], *args: Any, **kwargs: Any) -> Optional[Any]:
        """Run `train_object(*args, **kwargs)`, or the script `train_object` with `args`
        (then --deepspeed and the config), as every rank; rank 0's value (None for a script).

        Raises:
            JobFailedError: naming the failing rank, its error, traceback and last output.
        """
        self._check_encryption()
        if isinstance(train_object, str):
            if kwargs:
                raise ValueError("DeepspeedTorchDistributor with pytorch file doesn't support "
                                 "keyword arguments")
            main = _WithConfig(script_main(train_object, [str(a) for a in args]), self._config)
            self._launch(main, (), {})
            return None
        if not callable(train_object):
            raise TypeError(f"train_object must be a function or the path of a Python script, "
                            f"got {type(train_object).__name__}")
        return self._launch(_WithConfig(train_object, self._config), args, kwargs)
