"""The progress display: where the ranks are, as one bar per job on the driver.

Terms.  A *record* is one line a rank writes on its stdout: PROGRESS_MARK, then
a JSON object (never a pickle) with the rank's *totals* so far: steps done,
samples, seconds inside allreduce, and its *position* (epoch, step in the
epoch, steps per epoch, epochs).  Totals are cumulative, so a dropped record
loses nothing but a moment of display.  Records ride the channels that rank
output already takes to the driver: the pipes of the local launcher, and under
Spark the task's authenticated log channel, as a `log_to_driver` line (so they
pass whatever `driver_log_verbosity` says).

Rank side.  `report(...)`, called once per step in a training loop, updates
the totals and writes a record at most every MIN_INTERVAL seconds, and always
at the last step of an epoch.  It does nothing unless the driver asked for
progress (HVS_PROGRESS=1 in the rank environment: verbose >= 1), so a plain
`python train.py` or an `mpiexec` run prints no records.  `Tracked` wraps the
job's function on the ranks: when that function never calls `report`, a hook
on every `hvd.DistributedOptimizer` step, or every optimizer step once
torch.distributed is initialized (torch's global optimizer step hook), counts the steps, and the fusion engine's metrics give the seconds inside
allreduce.  The adapters tell this module what it needs of them: each
registers the seconds its engine spends in collectives (`add_engine_source`),
and torch's adapter its optimizer class (`count_steps_of`).
`keras_callback()` reports the batches of a Keras `model.fit`.

Driver side.  A `Display` sits in front of the stream the rank lines are
written to (`Display.stream`): it takes records out, passes every other line
through, and renders one tqdm bar (`tqdm.auto`: a widget in a notebook with
ipywidgets, text elsewhere).  *Throughput* is the sum over ranks of each
rank's samples per second over its last WINDOW seconds; the *allreduce share*
is the mean over ranks of their seconds in allreduce per second over the
same window.  A record that does not parse is dropped, and no display error
reaches the job: a broken channel never fails it.
"""
from __future__ import annotations

import json
import math
import operator
import os
import sys
import threading
import time
from typing import Any, Callable, List, Optional

from ..settings import LOG_CALLBACK, PROGRESS
from .marks import CALLBACK_MARK, ENABLED, PROGRESS_MARK

__all__ = ["report", "keras_callback", "Tracked", "PROGRESS_MARK", "ENABLED",
           "add_engine_source", "count_steps_of"]

MIN_INTERVAL = 0.25   # seconds between two records of one rank (epoch ends excepted)


# --------------------------------------------------------------------------- rank side

class _Totals:
    """This rank's totals and position; one per process."""

    def __init__(self) -> None:
        # the rank's edge for progress: the driver's switches, read once per process
        self.on = PROGRESS.read()
        self.lead = CALLBACK_MARK if LOG_CALLBACK.read() else ""
        self.lock = threading.Lock()
        self.rank = int(os.environ.get("HVS_RANK", "0") or 0)
        self.t0 = time.monotonic()
        self.done, self.samples, self.allreduce_s = 0, 0, 0.0
        self.measured = False          # allreduce_s measured (an engine, or report's figure)
        self.position: dict = {}
        self.loss: Optional[float] = None
        self.emitted = -math.inf
        self.explicit = False          # report() was called: the step hook stands aside
        self._engine_seen = 0.0        # the engine's collective_s when last read


_totals: Optional[_Totals] = None
_totals_lock = threading.Lock()


def _rank_totals() -> Optional[_Totals]:
    """This rank's totals, or None when the driver asked for no progress."""
    global _totals
    with _totals_lock:
        if _totals is None:
            _totals = _Totals()
        return _totals if _totals.on else None


_ENGINE_SOURCES: List[Callable[[], Optional[float]]] = []
_STEPPED: list = []  # optimizer classes whose steps the hook counts


def add_engine_source(seconds: Callable[[], Optional[float]]) -> None:
    """Register an adapter's engine: `seconds()` is the time it has spent in collectives
    so far, or None while it is not initialized.  The first initialized one counts."""
    _ENGINE_SOURCES.append(seconds)


def count_steps_of(cls: type) -> None:
    """Count every step of an optimizer of class `cls` (the torch adapter's
    DistributedOptimizer) as a training step, unless the job calls report()."""
    _STEPPED.append(cls)


def _engine_seconds(s: _Totals) -> float:
    """Seconds the torch or tensorflow adapter's engine spent in collectives since the last call."""
    now = None
    for seconds in list(_ENGINE_SOURCES):
        try:
            now = seconds()
        except Exception:  # shut down between the check and the read
            return 0.0
        if now is not None:
            break
    if now is None:  # no engine: a torch.distributed job's time in collectives is not ours
        return 0.0
    s.measured = True
    delta = now - s._engine_seen if now >= s._engine_seen else now  # a metrics reset
    s._engine_seen = now
    return delta


def _record(s: _Totals, final: bool = False) -> str:
    rec = {"rank": s.rank, "t": round(time.monotonic() - s.t0, 4), "done": s.done,
           "samples": s.samples, "final": final}
    if s.measured:
        rec["allreduce_s"] = round(s.allreduce_s, 6)
    rec.update(s.position)
    if s.loss is not None and math.isfinite(s.loss):
        rec["loss"] = s.loss
    s.emitted = time.monotonic()
    return json.dumps(rec, separators=(",", ":"))


def _due(s: _Totals, force: bool) -> Optional[str]:
    if force or time.monotonic() - s.emitted >= MIN_INTERVAL:
        return _record(s)
    return None


def _write(s: _Totals, line: Optional[str]) -> None:
    """One whole line on fd 1: not through sys.stdout, which user code may swap or buffer."""
    if line is None:
        return
    data = (s.lead + PROGRESS_MARK + line + "\n").encode()
    try:
        while data:
            data = data[os.write(1, data):]
    except OSError:  # a broken channel never fails the job
        pass


def _number(name: str, value: Any, integer: bool = False) -> Any:
    """value as an int (a count) or a float, numpy and torch scalars included."""
    if value is None:
        return None
    try:
        if isinstance(value, (str, bytes, bool)):
            raise TypeError
        value = operator.index(value) if integer else float(value)
    except (TypeError, ValueError):
        raise TypeError(f"progress.report: {name} must be {'an int' if integer else 'a number'}, "
                        f"got {type(value).__name__}") from None
    if value < 0:
        raise ValueError(f"progress.report: {name} must be >= 0, got {value!r}")
    return value


def report(*, epoch: Optional[int] = None, step: Optional[int] = None,
           steps: Optional[int] = None, samples: Optional[int] = None,
           allreduce_time: Optional[float] = None, loss: Optional[float] = None,
           epochs: Optional[int] = None) -> None:
    """Tell the driver's progress display where this rank is; call it once per step.

    Args:
        epoch: the current epoch, counted from 0 (as `range(epochs)` gives it).
        step: the step just finished in this epoch, counted from 0 (as `enumerate`).
        steps: steps per epoch.  epochs: epochs in the job.
        samples: samples this rank processed in this step; the driver adds up every rank's.
        allreduce_time: seconds this rank spent in allreduce in this step; by default
            what horovod_spark.torch's engine measured, when it is initialized.
        loss: the latest loss, shown as it is.

    A no-op unless the driver shows progress (verbose >= 1); never raises for a
    channel problem.

    Raises:
        TypeError / ValueError: an argument that is not a number >= 0.
    """
    ints = {k: _number(k, v, integer=True) for k, v in
            (("epoch", epoch), ("step", step), ("steps", steps), ("epochs", epochs))}
    samples = _number("samples", samples, integer=True)
    allreduce_time = _number("allreduce_time", allreduce_time)
    try:  # a loss may be negative
        loss = None if loss is None else float(loss)
    except (TypeError, ValueError):
        raise TypeError(f"progress.report: loss must be a number, "
                        f"got {type(loss).__name__}") from None
    s = _rank_totals()
    if s is None:
        return
    with s.lock:
        if not s.explicit:  # steps the hook counted before the first report() are not steps
            s.explicit, s.done = True, 0
        if step is not None:
            s.done += 1
            ints["step"] = step + 1
        s.samples += samples or 0
        if allreduce_time is not None:
            s.allreduce_s += allreduce_time
            s.measured = True
        else:
            s.allreduce_s += _engine_seconds(s)
        s.loss = loss if loss is not None else s.loss
        epoch_changed = epoch is not None and s.position.get("epoch") != epoch
        s.position.update({k: v for k, v in ints.items() if v is not None})
        at_end = step is not None and steps is not None and step + 1 >= steps
        line = _due(s, epoch_changed or at_end)
    _write(s, line)


def _is_distributed(optimizer) -> bool:
    """A step of hvd.DistributedOptimizer, or any optimizer's in a torch.distributed job (DDP,
    FSDP, Lightning, Hugging Face: their gradients are reduced before the step)."""
    if isinstance(optimizer, tuple(_STEPPED)):
        return True
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def _on_step(optimizer, _args, _kwargs) -> None:
    """torch's global optimizer step post-hook: one distributed step is done."""
    s = _totals
    try:
        if s is None or not s.on or s.explicit or not _is_distributed(optimizer):
            return
        with s.lock:
            s.done += 1
            s.allreduce_s += _engine_seconds(s)
            # the first step waits: a report() right after it makes the job explicit
            line = _due(s, False) if s.done > 1 else None
        _write(s, line)
    except Exception:  # a display problem never fails a training step
        pass


class _StepHook:
    """Registers _on_step with torch as soon as the job has imported torch."""

    def __init__(self) -> None:
        self.handle = None
        self.stop = threading.Event()
        if not self._try_register():
            threading.Thread(target=self._watch, name="hvs-progress", daemon=True).start()

    def _try_register(self) -> bool:
        optim = sys.modules.get("torch.optim.optimizer")
        if optim is None or not hasattr(optim, "register_optimizer_step_post_hook"):
            return False
        self.handle = optim.register_optimizer_step_post_hook(_on_step)
        return True

    def _watch(self) -> None:
        while not self.stop.wait(0.05):
            try:
                if self._try_register():
                    return
            except Exception:
                return

    def remove(self) -> None:
        self.stop.set()
        if self.handle is not None:
            self.handle.remove()


class Tracked:
    """The job's function as the ranks run it, with the automatic step hook.

    Picklable when `fn` is; returns what `fn` returns and raises what it raises.
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # noqa: F841 - the rank's traceback starts at the user's code
        s = _rank_totals()
        if s is None:
            return self.fn(*args, **kwargs)
        try:
            hook = _StepHook()
        except Exception:
            hook = None
        try:
            return self.fn(*args, **kwargs)
        finally:
            if hook is not None:
                hook.remove()
            with s.lock:
                line = _record(s, final=True) if s.done else None
            _write(s, line)


def keras_callback(batch_size: Optional[int] = None):
    """A Keras callback that reports every batch of `model.fit` to the progress display.

    Add it to fit's callbacks on every rank (KerasEstimator runs its `callbacks` on every
    rank).  `batch_size`: samples per batch on this rank, for samples/s.
    """
    import keras

    class KerasProgress(keras.callbacks.Callback):
        epoch = 0

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            params = self.params or {}
            loss = (logs or {}).get("loss")
            report(epoch=self.epoch, epochs=params.get("epochs"), step=batch,
                   steps=params.get("steps"), loss=None if loss is None else float(loss),
                   samples=batch_size)

    return KerasProgress()  # pickled by value
