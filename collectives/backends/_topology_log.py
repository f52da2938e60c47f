"""One DEBUG line per communicator: where its ranks are and which path each size takes.

HOROVOD_LOG_LEVEL=DEBUG (applied by collectives.logs when a rank joins) prints
it on every rank, as the native backend starts, so that a reader of the job's output sees which transport carries
what: the hosts, their shared-memory groups (ranks of a host that see one
/dev/shm), the TCP ring between the groups' first ranks, and the allreduce
algorithm per message size.
"""
from __future__ import annotations

import logging

__all__ = ["describe_topology", "log"]

log = logging.getLogger("collectives.topology")


def _kib(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and not n % (1 << 20) else f"{n >> 10} KiB"


def describe_topology(topo, tune: dict, cma: bool) -> str:
    groups = {}
    for r in range(topo.size):
        groups.setdefault(topo.group_of(r), []).append(r)
    hosts = {}
    for g, ranks in groups.items():
        hosts.setdefault(topo.hosts[ranks[0]], []).append(ranks)
    where = "; ".join(f"{h}: " + " | ".join(",".join(map(str, rs)) for rs in gs)
                      for h, gs in hosts.items())
    leaders = [rs[0] for rs in groups.values()]
    shm = (f"shm one step up to {_kib(tune['small_bytes'])}, staged above"
           + (f", cross-memory attach from {_kib(tune['cma_bytes'])}"
              if cma and tune["cma_bytes"] and len(groups) < topo.size else ""))
    tcp = (f"TCP ring between group leaders {' -> '.join(map(str, leaders))} "
           f"(chunks of {_kib(tune['tcp_chunk'])})" if len(leaders) > 1 else "no TCP")
    if len(groups) == topo.size:
        algo = tcp
    elif len(groups) == 1:
        algo = shm
    else:
        algo = f"{shm} within a group, then {tcp}, then shm broadcast" + (
            f"; from {_kib(2 * tune['hier_chunk'])} pipelined in chunks of "
            f"{_kib(tune['hier_chunk'])} (the ring of one chunk beside the shm phases of the "
            f"next and the previous, by cross-memory attach)"
            if cma and tune["hier_chunk"] and tune["cma_bytes"] else "")
    return (f"topology of rank {topo.rank}/{topo.size}: {_n(len(hosts), 'host')}, "
            f"{_n(len(groups), 'shared-memory group')} [{where}] (host: ranks, '|' between "
            f"groups); allreduce: {algo}")


def _n(count: int, what: str) -> str:
    return f"{count} {what}{'' if count == 1 else 's'}"
