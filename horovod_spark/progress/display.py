"""The driver side of the progress display: records in, one tqdm bar out.

See `horovod_spark.progress` for the record and the terms.  A `Display` sits in
front of the stream the output pumps write rank lines to (`Display.stream`):
lines that carry PROGRESS_MARK are records, taken out and rendered; every other
line passes through, with the bar cleared off the terminal line and redrawn
around it.  The bar's position and steps/s are the lead rank's (the lowest that
reports); samples/s add up every rank, over the same window (`_window_rates`).
Where the file is not a terminal (a batch job's log, a pipe) a plain line every
PLAIN_EVERY seconds and one at the end take the bar's place.
"""
from __future__ import annotations

import collections
import json
import math
import re
import sys
import threading
import time
from typing import Any, Optional

from .marks import CALLBACK_MARK, ENABLED, POSITION, PROGRESS_MARK, WINDOW

__all__ = ["Display"]

PLAIN_EVERY = 10.0  # seconds between two plain lines (the file is not a terminal)
_BAR = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]"
_BAR_NO_TOTAL = "{desc}: {n_fmt} steps [{elapsed}{postfix}]"
_LABEL = re.compile(r"^(.*?\[\d+\]<\w+>:)?(.*)$", re.S)


def _bar_class():
    """tqdm.auto's choice, without its warning where a notebook lacks ipywidgets."""
    import importlib.util

    if importlib.util.find_spec("ipywidgets") is None:
        from tqdm.std import tqdm
    else:
        from tqdm.auto import tqdm
    return tqdm


def _valid(rec: Any) -> bool:
    if not isinstance(rec, dict) or not isinstance(rec.get("rank"), int) or rec["rank"] < 0:
        return False
    for key in ("t", "done", "samples", "allreduce_s") + POSITION:
        v = rec.get(key, 0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return False
    return True


class Display:
    """One progress bar per job on the driver, fed by the ranks' records.

    Args:
        verbose: 0 shows nothing and asks the ranks for no records.
        file: where the bar goes (default, as they are now in this thread: sys.stderr; in a
            Jupyter kernel sys.stdout, the stream the rank lines go to, so that the bar stays
            one line under them).
        desc: the bar's label before the first epoch is known.
        plain: plain lines instead of a bar; default: where `file` is not a terminal
            (nor a Jupyter kernel's stream).
    """

    def __init__(self, verbose: int = 1, file=None, desc: str = "training",
                 plain: Optional[bool] = None) -> None:
        self.enabled = verbose >= 1
        self.env = ENABLED if self.enabled else ()
        self._file = file if file is not None else _default_file()
        self._plain = not _is_terminal(self._file) if plain is None else plain
        self._plain_at: Optional[float] = None   # when the last plain line was written
        self._plain_last = ""
        self._desc = desc
        self._lock = threading.RLock()
        self._ranks: dict = {}       # rank -> deque of its recent records
        self._bar = None
        self.records = 0             # records taken in (for tests and summaries)
        self.dropped = 0             # lines with the mark that did not parse

    def stream(self, target=None, default: str = "stdout") -> "_RoutingStream":
        """A stream for rank lines: records go to the bar, the rest to `target` (default:
        sys.<default>, looked up at each write, so a notebook cell gets its lines)."""
        return _RoutingStream(self, target, default)

    def feed_line(self, text: str) -> None:
        """Take one record line (the text after PROGRESS_MARK)."""
        try:
            rec = json.loads(text)
        except ValueError:
            rec = None
        if not _valid(rec):
            self.dropped += 1
            return
        with self._lock:
            recent = self._ranks.setdefault(rec["rank"], collections.deque(maxlen=256))
            recent.append(rec)
            self.records += 1
            if self.enabled:
                try:
                    self._render()
                except Exception:  # a display problem never fails the job
                    self.enabled = False

    def rates(self) -> tuple:
        """(samples per second over every rank, mean allreduce share, 0..1) right now."""
        with self._lock:
            per_rank = [_window_rates(r) for r in self._ranks.values()]
        samples = sum(p[0] for p in per_rank)
        shares = [p[1] for p in per_rank if p[1] is not None]
        return samples, (sum(shares) / len(shares) if shares else None)

    def step_rate(self) -> float:
        """The lead rank's optimizer steps per second over the same window as `rates`."""
        with self._lock:
            return _window_rates(self._ranks[min(self._ranks)])[2] if self._ranks else 0.0

    def _lead(self) -> dict:
        return self._ranks[min(self._ranks)][-1]

    def _render(self) -> None:
        if self._plain:
            return self._render_plain(final=False)
        total, n, desc = _position(self._lead(), self._desc)
        bar = self._bar
        if bar is None:
            bar = self._bar = _bar_class()(total=total, desc=desc, unit="step", file=self._file,
                                           leave=True, dynamic_ncols=True, mininterval=0.2,
                                           bar_format=_BAR if total else _BAR_NO_TOTAL)
        elif total != bar.total:
            bar.bar_format = _BAR if total else _BAR_NO_TOTAL
            bar.reset(total=total)
        bar.set_description_str(desc, refresh=False)
        bar.set_postfix_str(self._postfix(), refresh=False)
        if n < bar.n:  # a new epoch on a bar per epoch
            bar.reset(total=total)
        bar.update(n - bar.n)

    def _render_plain(self, final: bool) -> None:
        now = time.monotonic()
        if not final and self._plain_at is not None and now - self._plain_at < PLAIN_EVERY:
            return
        total, n, desc = _position(self._lead(), self._desc)
        where = f"{desc}: {100 * n / total:.0f}% {n}/{total} steps" if total else f"{desc}: {n} steps"
        line = ", ".join(filter(None, [where, self._postfix()]))
        if final and line == self._plain_last:
            return
        self._file.write(line + "\n")
        self._file.flush()
        self._plain_at, self._plain_last = now, line

    def _postfix(self) -> str:
        samples, share = self.rates()
        steps = self.step_rate()
        # three figures below 100 (57.3), whole steps with separators above (1,520): never 1.52e+03
        rate = f"{steps:,.0f}" if steps >= 100 else f"{steps:.3g}"
        parts = [f"{rate} step/s"] if steps > 0 else []
        loss = self._lead().get("loss")
        if loss is not None:
            parts.append(f"loss {loss:.4g}")
        if samples > 0:
            parts.append(f"{samples:,.0f} samples/s")
        if share is not None:
            parts.append(f"allreduce {100 * min(share, 1.0):.0f}%")
        return ", ".join(parts)

    def clear(self) -> None:
        """Take the bar off the terminal line before other output is written."""
        if self._bar is not None:
            try:
                self._bar.clear()
            except Exception:
                pass

    def refresh(self) -> None:
        if self._bar is not None:
            try:
                self._bar.refresh()
            except Exception:
                pass

    def close(self) -> None:
        with self._lock:
            if self._plain and self.enabled and self._ranks:
                try:
                    self._render_plain(final=True)
                except Exception:  # a display problem never fails the job
                    pass
            bar, self._bar = self._bar, None
        if bar is not None:
            try:
                bar.refresh()
                bar.close()
            except Exception:
                pass

    def __enter__(self) -> "Display":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _is_terminal(file) -> bool:
    if type(file).__module__.startswith("ipykernel"):  # a notebook renders \r updates
        return True
    try:
        return bool(file.isatty())
    except Exception:
        return False


def _default_file():
    in_kernel = type(sys.stdout).__module__.startswith("ipykernel")
    return sys.stdout if in_kernel else sys.stderr


def _window_rates(recent) -> tuple:
    """(samples/s, allreduce share or None, steps/s) of one rank over its last WINDOW seconds."""
    last = recent[-1]
    first = next((r for r in recent if last["t"] - r["t"] <= WINDOW), last)
    if first is last:
        span, samples, ar, done = last["t"], last["samples"], last.get("allreduce_s", 0), last["done"]
    else:
        span = last["t"] - first["t"]
        samples = last["samples"] - first["samples"]
        ar = last.get("allreduce_s", 0) - first.get("allreduce_s", 0)
        done = last["done"] - first["done"]
    if span <= 0:
        return 0.0, None, 0.0
    measured = "allreduce_s" in last  # a rank without our engine (torch.distributed) says none
    return samples / span, ar / span if measured else None, done / span


def _position(rec: dict, desc: str) -> tuple:
    """(bar total, bar position, label) from the lead rank's record."""
    epoch, epochs, step, steps = (rec.get(k) for k in POSITION)
    if epoch is not None:
        desc = f"epoch {epoch + 1}" + (f"/{epochs}" if epochs else "")
    if steps and epochs and epoch is not None:
        return steps * epochs, epoch * steps + (step or 0), desc
    if steps:
        return steps, step or 0, desc
    return None, rec.get("done", 0), desc


class _RoutingStream:
    """What the output pumps write rank lines to: records to the display, the rest on."""

    def __init__(self, display: Display, target=None, default: str = "stdout") -> None:
        self.display, self._target, self._default = display, target, default

    def _out(self):
        return self._target if self._target is not None else getattr(sys, self._default)

    def write(self, text: str) -> int:
        if PROGRESS_MARK in text:
            head, _, rest = text.partition(PROGRESS_MARK)
            self.display.feed_line(rest.strip())
            label, own = _LABEL.match(head.replace(CALLBACK_MARK, "")).groups()
            if not own.strip():
                return len(text)
            text = (label or "") + own + "\n"  # the start of a line the rank left unfinished
        with self.display._lock:
            self.display.clear()
            out = self._out()
            out.write(text)
            out.flush()
            self.display.refresh()
        return len(text)

    def flush(self) -> None:
        self._out().flush()

    def isatty(self) -> bool:
        return bool(getattr(self._out(), "isatty", lambda: False)())
