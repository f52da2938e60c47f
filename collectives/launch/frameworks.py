"""What tf.distribute and JAX read to find their peers, for every rank as torchrun's.

Terms.  A *TF port* is a port a rank's launcher reserves on the rank's address for the
rank's tf.distribute server (`torchrun.reserve_port`'s way: bound with SO_REUSEADDR, never
listening, held until the rank ends, so TensorFlow's gRPC server can bind it and nobody
else can take it meanwhile); the launcher publishes it, as `host:port`, under
`{job}/tf/worker/{rank}`, one store request a rank, where TensorFlow is installed at all.
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

__all__ = ["VARIABLES", "tf_installed", "publish_tf_port", "tf_config", "jax_environ"]

#: Per job and per rank: never part of what a rank inherits (a warm start's key).
VARIABLES = ("TF_CONFIG", "JAX_COORDINATOR_ADDRESS")


def tf_installed() -> bool:
    """Whether this interpreter could import TensorFlow (the launcher's side decides by it
    whether a rank gets a TF port)."""
    try:
        return importlib.util.find_spec("tensorflow") is not None
    except (ImportError, ValueError):
        return False


def _key(job: str, rank: int) -> str:
    return f"{job}/tf/worker/{rank}"


def publish_tf_port(store, job: str, rank: int, address: str) -> socket.socket:
    """Reserve rank `rank`'s TF port on `address` and publish it; the holding socket, to
    close when the rank has ended."""
    held = reserve_port(address)
    host = f"[{address}]" if ":" in address else address
    store.set(_key(job, rank), f"{host}:{held.getsockname()[1]}".encode())
    return held


def tf_config(store, job: str, rank: int, size: int, timeout: float) -> Optional[str]:
    """TF_CONFIG of rank `rank`: every rank a worker at its TF port, this one `rank`; None
    where the launcher published no ports (TensorFlow missing where the tasks run)."""
    if not store.check(_key(job, rank)):
        return None
    workers = [v.decode() for v in store.get_many([_key(job, r) for r in range(size)], timeout)]
    return json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}})


def jax_environ(master: str, port: int) -> dict:
    """JAX_COORDINATOR_ADDRESS: rank 0's address and the job's MASTER_PORT."""
    host = f"[{master}]" if ":" in master else master
    return {"JAX_COORDINATOR_ADDRESS": f"{host}:{port}"}
