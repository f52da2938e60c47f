"""Helpers shared by the benchmarks that run this project beside its peers.

Every implementation runs in its own group of real rank processes started by
`collectives.launch.run_local` (so ours and torch.distributed's see the same
launcher, the same environment and one thread per rank).
"""
from __future__ import annotations

import os
import resource
import socket
import statistics
import time
from typing import Callable, Dict, List, Optional

__all__ = ["free_port", "with_free_port", "gloo_init", "timed", "cpu_seconds", "summarize", "slowest", "load"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_free_port(run: Callable[[int], object], tries: int = 4):
    """run(port) with a fresh free port, again when another process took the port first."""
    for attempt in range(tries):
        try:
            return run(free_port())
        except Exception as exc:  # RankFailed carrying the rank's EADDRINUSE
            if "EADDRINUSE" not in str(exc) or attempt == tries - 1:
                raise


def gloo_init(port: int) -> None:
    """torch.distributed over Gloo on the launcher's ranks."""
    import torch.distributed as dist

    rank, size = int(os.environ["HVS_RANK"]), int(os.environ["HVS_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)


def timed(step: Callable[[], None], barrier: Callable[[], None], warmup: int, reps: int,
          cpu: Optional[list] = None) -> List[float]:
    """Seconds of each of `reps` calls of step(), each started together after a barrier.

    cpu: if given, receives the CPU seconds (every thread of this process) of each call.
    """
    for _ in range(warmup):
        step()
    out = []
    for _ in range(reps):
        barrier()
        t, c = time.perf_counter(), cpu_seconds()
        step()
        out.append(time.perf_counter() - t)
        if cpu is not None:
            cpu.append(cpu_seconds() - c)
    return out


def cpu_seconds() -> float:
    """User + system CPU seconds of this process, every thread included."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def slowest(per_rank: List[List[float]]) -> List[float]:
    """Per repetition, the time of the slowest rank (what a synchronous job waits for)."""
    return [max(ts) for ts in zip(*per_rank)]


def summarize(times: List[float]) -> Dict[str, float]:
    return {"median_s": statistics.median(times), "mean_s": statistics.fmean(times),
            "best_s": min(times), "reps": len(times)}


def load() -> List[float]:
    try:
        return list(os.getloadavg())
    except OSError:
        return []
