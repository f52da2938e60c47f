"""HOROVOD_AUTOTUNE: the fusion threshold and the cycle time, tuned online on every rank alike.

Terms.  A *sample* is a stretch of the job's allreduces that ends when some tensor name
has been reduced `steps_per_sample` times since the sample began (about that many training
steps, Horovod's rule); its *score* is the bytes the job's allreduces moved per second of
wall time on rank 0, so a setting that makes the steps themselves faster (less waiting in
a cycle, fewer fused copies) scores higher.  A setting runs for SUBSAMPLES samples and
scores their median, as Horovod's did; the first `warmup_samples` settings' scores are
discarded.

The *search* runs on rank 0 only: four starting points, then Bayesian optimisation (a
Gaussian process over log2 of the threshold and of the cycle time, on a grid of the
values below, with expected improvement as the choice) for `max_samples` samples; then
the best setting is kept and tuning stops.  Rank 0's choice reaches every rank in the
same cycle: samples end on data every rank agrees on (the cycle's ready tensors), and at
a setting's last sample's end each rank contributes to one control allreduce (tagged as the engine's
coordination is, HOROVOD_SPARK_MESH_INTEGRITY) in which rank 0's values are the only
non-zero ones.  Every rank then applies the same threshold (fusion groups stay identical)
from the next cycle on.  While tuning, the engine keeps its cycles in Python (the C++ lane
is off, so every rank counts the same cycles); once tuned the lane runs again.

Rank 0 writes the samples to HOROVOD_AUTOTUNE_LOG as Horovod did: a CSV with a header
line, one row per scored sample and the best setting last.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Dict, List, Tuple

import numpy as np

from ..types import DType, ReduceOp

__all__ = ["Autotuner", "THRESHOLDS_MIB", "CYCLE_TIMES_MS", "LOG_HEADER"]

log = logging.getLogger("collectives.fusion")

#: The fusion thresholds tried, in MiB (0: no fusion), and the cycle times, in ms.
THRESHOLDS_MIB = (0.0, 0.25, 1.0, 4.0, 16.0, 64.0, 128.0)
CYCLE_TIMES_MS = (0.0, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0)
#: Where the search starts: the job's own setting, then these.
START = ((64.0, 1.0), (4.0, 5.0), (16.0, 0.5), (1.0, 10.0), (0.25, 0.0))
#: Horovod's columns (its hierarchical flags are always on here: shared memory within a
#: host, the leaders across hosts).
#: Samples a setting runs for; its score is their median (Horovod's five).
SUBSAMPLES = 5
LOG_HEADER = "hierarchical_allreduce,hierarchical_allgather,cycle_time_ms,tensor_fusion_threshold,score"


def _coords(point: Tuple[float, float]) -> np.ndarray:
    """A (threshold MiB, cycle ms) point in the search's space: log2, 0 at the smallest."""
    mib, ms = point
    return np.array([math.log2(mib + 0.125), math.log2(ms + 0.25)])


class _Search:
    """Rank 0's search over the grid (see the module docstring)."""

    def __init__(self, max_samples: int, noise: float, first: Tuple[float, float]) -> None:
        self.start = (first,) + tuple(p for p in START[1:] if p != first)
        self.grid = [(t, c) for t in THRESHOLDS_MIB for c in CYCLE_TIMES_MS]
        self._x = np.array([_coords(p) for p in self.grid])
        self._span = self._x.max(axis=0) - self._x.min(axis=0)
        self.max_samples, self.noise = max_samples, noise
        self.tried: List[Tuple[Tuple[float, float], float]] = []

    def best(self) -> Tuple[Tuple[float, float], float]:
        return max(self.tried, key=lambda t: t[1])

    def done(self) -> bool:
        return len(self.tried) >= self.max_samples

    def add(self, point: Tuple[float, float], score: float) -> None:
        self.tried.append((point, score))

    def next(self) -> Tuple[float, float]:
        if len(self.tried) < len(self.start):
            return self.start[len(self.tried)]
        seen = {p for p, _ in self.tried}
        xs = np.array([_coords(p) for p, _ in self.tried]) / self._span
        ys = np.array([s for _, s in self.tried])
        scale = ys.std() or 1.0
        ys = (ys - ys.mean()) / scale
        grid = self._x / self._span

        def kernel(a, b):  # squared exponential, length 0.25 of the span
            d = ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)
            return np.exp(-d / (2 * 0.25 ** 2))

        k = kernel(xs, xs) + (self.noise ** 2) * np.eye(len(xs))
        ks = kernel(grid, xs)
        alpha = np.linalg.solve(k, ys)
        mean = ks @ alpha
        var = np.clip(1.0 - np.einsum("ij,ji->i", ks, np.linalg.solve(k, ks.T)), 1e-9, None)
        sd = np.sqrt(var)
        best = ys.max()
        z = (mean - best) / sd
        cdf = 0.5 * (1 + np.vectorize(math.erf)(z / math.sqrt(2)))
        pdf = np.exp(-0.5 * z ** 2) / math.sqrt(2 * math.pi)
        ei = (mean - best) * cdf + sd * pdf
        for i in np.argsort(-ei):  # the best expected improvement not tried yet
            if self.grid[i] not in seen:
                return self.grid[i]
        return self.best()[0]


class Autotuner:
    """The engine's tuner: `cycle_done` after every cycle's ops; it changes the engine's
    threshold and cycle time through `apply(threshold_bytes, cycle_ms)`."""

    def __init__(self, comm, config, apply) -> None:
        self._comm, self._apply = comm, apply
        self.rank = comm.rank
        self.steps = config.autotune_steps_per_sample
        self.warmup = config.autotune_warmup_samples
        self.active = comm.size > 1
        self._point = (config.fusion_threshold / (1 << 20), config.cycle_time_ms)
        self._search = _Search(config.autotune_bayes_opt_max_samples,
                               config.autotune_gaussian_process_noise,
                               self._point) if self.rank == 0 else None
        self._counts: Dict[str, int] = {}
        self._scores: List[float] = []  # this setting's samples so far
        self._bytes, self._began = 0, time.perf_counter()
        self._file = None
        if self.rank == 0 and config.autotune_log:
            self._file = open(config.autotune_log, "w")
            self._file.write(LOG_HEADER + "\n")
            self._file.flush()
        self.samples = 0  # settings scored, the warm-up's too
        self.cycles = 0  # cycles with ready tensors while tuning (the same on every rank)
        self.history: List[Tuple[int, Tuple[float, float]]] = []  # (cycle, setting) changes

    def cycle_done(self, ready) -> None:
        """Count a cycle's agreed ready tensors; at a sample's end, score it and move on."""
        if not self.active or not ready:
            return
        self.cycles += 1
        ended = False
        for sig in ready:
            if sig.kind == "allreduce":
                self._bytes += sig.nbytes
            n = self._counts[sig.name] = self._counts.get(sig.name, 0) + 1
            ended = ended or n > self.steps
        if ended:
            self._end_sample()

    def _end_sample(self) -> None:
        now = time.perf_counter()
        self._scores.append(self._bytes / max(now - self._began, 1e-9) / 1e6)  # MB/s
        self._counts, self._bytes = {}, 0
        if len(self._scores) < SUBSAMPLES:  # the same setting again (no word needed)
            self._began = time.perf_counter()
            return
        score, self._scores = float(np.median(self._scores)), []
        out = np.zeros(3, np.float64)  # threshold MiB, cycle ms, still tuning: rank 0's
        if self.rank == 0:
            if self.warmup > 0:
                self.warmup -= 1
                point, more = self._point, True
            else:
                self._search.add(self._point, score)
                self._write(self._point, score)
                more = not self._search.done()
                point = self._search.next() if more else self._search.best()[0]
                if not more:
                    best, best_score = self._search.best()
                    self._write(best, best_score)
                    log.info("autotune: best fusion threshold %g MiB, cycle time %g ms "
                             "(%.1f MB/s)", best[0], best[1], best_score)
            out[:] = (point[0], point[1], 1.0 if more else 0.0)
        self._comm.allreduce_flat(out, out, DType.FLOAT64, ReduceOp.SUM, name="fusion.autotune",
                                  control=True)
        self.samples += 1
        self._set((float(out[0]), float(out[1])))
        if out[2] == 0.0:
            self.active = False
            self.close()
        self._began = time.perf_counter()

    def _set(self, point: Tuple[float, float]) -> None:
        self._point = point
        self.history.append((self.cycles, point))
        self._apply(int(point[0] * (1 << 20)), point[1])

    def _write(self, point, score: float) -> None:
        if self._file is not None:
            self._file.write(f"1,1,{point[1]:g},{point[0]:g},{score:.6g}\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    @property
    def point(self) -> Tuple[float, float]:
        """(fusion threshold MiB, cycle time ms) in use."""
        return self._point
