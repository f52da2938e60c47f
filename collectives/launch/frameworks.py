"""What tf.distribute and JAX read to find their peers, for every rank as torchrun's.

Terms.  A *TF port* is a port a rank's launcher reserves on the rank's address for the
rank's tf.distribute server (`torchrun.reserve_port`'s way: bound with SO_REUSEADDR, never
listening, held until the rank ends, so TensorFlow's gRPC server can bind it and nobody
else can take it meanwhile); the launcher publishes it, as `host:port`, under
`{job}/tf/worker/{rank}` (`tf_port_key`), where TensorFlow is installed at all: one store
request a rank on one host, in the store round's messages on Spark tasks whose store is
rank 0's (`SparkStore.share`).
TF_CONFIG, which lists every worker, is made by the rank itself when it first imports
TensorFlow (`tf_config`: one get_many), so a job that never imports it reads nothing.
JAX's coordinator is rank 0's MASTER_ADDR:MASTER_PORT (JAX_COORDINATOR_ADDRESS): a job
runs torch.distributed's TCPStore or JAX's coordinator there, not both.
"""
from __future__ import annotations

import importlib.util
import json
import socket
from typing import Optional

from .torchrun import reserve_port

__all__ = ["VARIABLES", "tf_installed", "tf_port_key", "reserve_tf_port", "tf_config",
           "jax_environ"]

#: Per job and per rank: never part of what a rank inherits (a warm start's key).
VARIABLES = ("TF_CONFIG", "JAX_COORDINATOR_ADDRESS")


def tf_installed() -> bool:
    """Whether this interpreter could import TensorFlow (the launcher's side decides by it
    whether a rank gets a TF port)."""
    try:
        return importlib.util.find_spec("tensorflow") is not None
    except (ImportError, ValueError):
        return False


def tf_port_key(job: str, rank: int) -> str:
    """The key rank `rank`'s TF port is published under."""
    return f"{job}/tf/worker/{rank}"



def reserve_tf_port(address: str) -> tuple:
    """A TF port on `address`: (the holding socket, to close when the rank has ended; the
    value to publish, `host:port`)."""
    held = reserve_port(address)
    host = f"[{address}]" if ":" in address else address
    return held, f"{host}:{held.getsockname()[1]}".encode()


def tf_config(store, job: str, rank: int, size: int, timeout: float) -> Optional[str]:
    """TF_CONFIG of rank `rank`: every rank a worker at its TF port, this one `rank`; None
    where the launcher published no ports (TensorFlow missing where the tasks run)."""
    if not store.check(tf_port_key(job, rank)):
        return None
    workers = [v.decode() for v in store.get_many([tf_port_key(job, r) for r in range(size)], timeout)]
    return json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}})


def jax_environ(master: str, port: int) -> dict:
    """JAX_COORDINATOR_ADDRESS: rank 0's address and the job's MASTER_PORT."""
    host = f"[{master}]" if ":" in master else master
    return {"JAX_COORDINATOR_ADDRESS": f"{host}:{port}"}
