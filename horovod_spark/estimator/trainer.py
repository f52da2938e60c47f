"""Trainer features the estimators share: early stopping and the best epoch.

A *monitor* follows one metric of the per-epoch history (``val_loss``,
``accuracy``, ...) in a *mode*: ``min`` (losses, errors) or ``max`` (accuracy,
AUC); ``auto`` picks ``max`` for names that say accuracy, AUC, precision,
recall or F1, else ``min``.  An epoch *improves* when its value beats the best
so far by more than ``min_delta``.  Early stopping stops after ``patience``
epochs without improvement.  Both replay a resumed run's history, so a
resumed fit stops where one uninterrupted fit would have.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["EarlyStopping", "Monitor", "Watch", "default_monitor"]

_MAX_WORDS = ("acc", "auc", "precision", "recall", "f1")


def default_monitor(has_validation: bool) -> str:
    return "val_loss" if has_validation else "loss"


def _mode(metric: str, mode: str) -> str:
    if mode not in ("auto", "min", "max"):
        raise ValueError(f"mode must be 'auto', 'min' or 'max', got {mode!r}")
    if mode != "auto":
        return mode
    return "max" if any(w in metric.lower() for w in _MAX_WORDS) else "min"


@dataclasses.dataclass(frozen=True)
class EarlyStopping:
    """Stop training when ``monitor`` has not improved by more than ``min_delta`` for
    ``patience`` epochs (Keras's EarlyStopping, for both estimators)."""

    monitor: str = "val_loss"
    patience: int = 0
    min_delta: float = 0.0
    mode: str = "auto"

    def __post_init__(self):
        _mode(self.monitor, self.mode)
        if self.patience < 0 or self.min_delta < 0:
            raise ValueError(f"patience and min_delta must be >= 0, got {self.patience}, "
                             f"{self.min_delta}")

    @classmethod
    def of(cls, value: Any) -> Optional["EarlyStopping"]:
        """None, an EarlyStopping, or a dict of its fields."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
            if unknown:
                raise TypeError(f"early_stopping got unknown key(s) {unknown}; it takes "
                                f"monitor, patience, min_delta, mode")
            return cls(**value)
        raise TypeError(f"early_stopping must be an EarlyStopping or a dict, "
                        f"got {type(value).__name__}")


class Monitor:
    """The best value of one metric so far, and since when it has not improved."""

    def __init__(self, metric: str, mode: str = "auto", min_delta: float = 0.0):
        self.metric, self.mode, self.min_delta = metric, _mode(metric, mode), min_delta
        self.best: Optional[float] = None
        self.best_epoch = -1
        self.waited = 0  # epochs since the best one

    def update(self, epoch: int, metrics: Dict[str, float]) -> bool:
        """Whether ``epoch`` is the best so far."""
        if self.metric not in metrics:
            raise ValueError(f"the monitored metric {self.metric!r} is not among the epoch's "
                             f"metrics {sorted(metrics)}; monitor one of those (val_* ones "
                             f"need validation=...)")
        value = float(metrics[self.metric])
        better = not math.isnan(value) and (self.best is None or (
            value < self.best - self.min_delta if self.mode == "min"
            else value > self.best + self.min_delta))
        if better:
            self.best, self.best_epoch, self.waited = value, epoch, 0
        else:
            self.waited += 1
        return better

    def replay(self, history: Dict[str, List[float]]) -> None:
        """Follow the epochs of a resumed run's history."""
        epochs = len(next(iter(history.values()), []))
        for epoch in range(epochs):
            self.update(epoch, {k: v[epoch] for k, v in history.items() if len(v) > epoch})


def should_stop(rule: Optional[EarlyStopping], monitor: Optional[Monitor]) -> bool:
    return rule is not None and monitor is not None and 0 < monitor.waited >= rule.patience


class Watch:
    """Rank 0's monitors of one fit: early stopping's, and the one that picks the best
    epoch (``keep_best``: (metric, mode)); both replay a resumed run's history."""

    def __init__(self, rule: Optional[EarlyStopping], keep_best: Optional[Tuple[str, str]],
                 history: Dict[str, List[float]]):
        self.rule = rule
        self.early = Monitor(rule.monitor, rule.mode, rule.min_delta) if rule else None
        self.best = Monitor(*keep_best) if keep_best else None
        for monitor in (self.early, self.best):
            if monitor is not None:
                monitor.replay(history)

    def update(self, epoch: int, metrics: Dict[str, float]) -> bool:
        """Follow ``epoch``; whether it is the best one to keep."""
        if self.early is not None:
            self.early.update(epoch, metrics)
        return self.best is not None and self.best.update(epoch, metrics)

    @property
    def stop(self) -> bool:
        return should_stop(self.rule, self.early)

    @property
    def best_epoch(self) -> Optional[int]:
        return None if self.best is None or self.best.best_epoch < 0 else self.best.best_epoch
