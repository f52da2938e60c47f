"""torchrun's environment in every rank, so torch.distributed code runs as it is.

`torch.distributed.init_process_group()` (env://) reads MASTER_ADDR, MASTER_PORT, RANK
and WORLD_SIZE; Lightning, Hugging Face and accelerate tell a launched process by
LOCAL_RANK, TORCHELASTIC_RUN_ID and the node variables, and then start no processes of
their own.  Every launcher of the package sets them (`torchrun_environ`) beside the
HVS_* variables, from the same placement.

Terms.  The *master* is rank 0's address; its *port* is one that rank 0's launcher
*reserves* (`reserve_port`): a socket bound to the port on every address of the family
(torch's TCPStore listens on every address, not MASTER_ADDR alone) with SO_REUSEADDR and
never listening, held until the job ends, so no other process is given the port, neither
to listen nor as an outgoing connection's local port on another address, while torch's
TCPStore in rank 0 can still bind it (it sets SO_REUSEADDR too).  A *layout*
says what a node is: `hosts` (torchrun's: the ranks of a host are one node, LOCAL_RANK
is the rank's order on its host, as Horovod's local rank) or `tasks` (pyspark's
TorchDistributor on a cluster: every rank is a node of one process, LOCAL_RANK 0).
"""
from __future__ import annotations

import socket

__all__ = ["LAYOUTS", "VARIABLES", "reserve_port", "torchrun_environ"]

LAYOUTS = ("hosts", "tasks")
#: Every variable `torchrun_environ` sets: per job and per rank, never part of what a rank
#: inherits from elsewhere (a warm start's key, mpiexec's ranks).
VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
             "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME",
             "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


def reserve_port(address: str) -> socket.socket:
    """A socket that holds a port free on every address of `address`'s family for torch's
    store (see the module docstring); its port is `.getsockname()[1]`.  Close it when the
    job ends.  A port bound on `address` alone could be in use on another address (an
    outgoing connection's local port on loopback), where the store's listener then fails
    with EADDRINUSE."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
    except OSError:
        sock.close()
        raise
    return sock


def torchrun_environ(renv, master: str, port: int, run_id: str, restarts: int = 0,
                     layout: str = "hosts") -> dict:
    """torchrun's variables for the rank of `renv` (a `RankEnv`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "tasks":
        local, local_size, node, nodes = 0, 1, renv.rank, renv.size
    else:
        local, local_size, node, nodes = (renv.local_rank, renv.local_size, renv.cross_rank,
                                          renv.cross_size)
    values = {"MASTER_ADDR": master, "MASTER_PORT": port, "RANK": renv.rank,
              "WORLD_SIZE": renv.size, "LOCAL_RANK": local, "LOCAL_WORLD_SIZE": local_size,
              "GROUP_RANK": node, "NODE_RANK": node, "GROUP_WORLD_SIZE": nodes,
              "ROLE_NAME": "default", "ROLE_RANK": renv.rank, "ROLE_WORLD_SIZE": renv.size,
              "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": restarts}
    assert tuple(values) == VARIABLES
    return {k: str(v) for k, v in values.items()}
