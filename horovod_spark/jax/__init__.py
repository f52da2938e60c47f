"""JAX on the job's ranks: `jax.distributed.initialize()` with no arguments.

JAX finds its process count, process id and coordinator through its *cluster
environments* (SLURM, Open MPI, Kubernetes, ...), each a subclass of
`jax._src.clusters.ClusterEnv` that says whether it is present.  Imported in a rank (the
rank's setup does it when the function imports jax: `horovod_spark._autoload`), this module
adds one for this package's ranks: present where a launcher of this package set the rank
environment, with the rank and size it gives, its local rank, and the coordinator at
JAX_COORDINATOR_ADDRESS (rank 0's MASTER_ADDR:MASTER_PORT, which JAX also reads itself).
Cross-process collectives on CPU need `jax.config.update("jax_cpu_collectives_implementation",
"gloo")` before the first computation, as under any other launcher.
"""
from __future__ import annotations

import os
from typing import Optional

from jax._src import clusters

__all__ = ["HorovodSparkCluster"]


class HorovodSparkCluster(clusters.ClusterEnv):
    """The ranks of a horovod_spark job (Spark tasks, or local ranks)."""

    name: str = "horovod_spark"

    @classmethod
    def is_env_present(cls) -> bool:
        return "HVS_RANK" in os.environ and "JAX_COORDINATOR_ADDRESS" in os.environ

    @classmethod
    def get_coordinator_address(cls, timeout_secs: Optional[int],
                                override_coordinator_port: Optional[str] = None) -> str:
        address = os.environ["JAX_COORDINATOR_ADDRESS"]
        if override_coordinator_port:
            address = f"{address.rsplit(':', 1)[0]}:{override_coordinator_port}"
        return address

    @classmethod
    def get_process_count(cls) -> int:
        return int(os.environ["HVS_SIZE"])

    @classmethod
    def get_process_id(cls) -> int:
        return int(os.environ["HVS_RANK"])

    @classmethod
    def get_local_process_id(cls) -> Optional[int]:
        return int(os.environ["HVS_LOCAL_RANK"])
