"""nccl-tests-style tables and JSON results, shared by every benchmark.

A *row* is one message size: `{"size": bytes, "count": elements, "dtype":
name, "results": {impl: {"time_us": t}}}`.  `complete` fills algbw (bytes
moved by one rank per second, GB/s) and busbw (algbw scaled by the op's
bus factor, as nccl-tests does: 2(n-1)/n for allreduce, (n-1)/n for
allgather and reducescatter, 1 for broadcast), so numbers are comparable
across world sizes.  `format_table` prints one block of time/algbw/busbw per
implementation and the requested ratios (busbw of a over busbw of b), and
`write_json` stores everything under benchmarks/results/.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
from typing import Iterable, Optional, Sequence

__all__ = ["bus_factor", "complete", "format_table", "write_json", "human_size", "parse_size",
           "size_range"]

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def bus_factor(op: str, n: int) -> float:
    if n <= 1:
        return 1.0
    return {"allreduce": 2.0 * (n - 1) / n, "allgather": (n - 1) / n,
            "reducescatter": (n - 1) / n, "alltoall": (n - 1) / n}.get(op, 1.0)


def complete(rows: Sequence[dict], op: str, n: int) -> Sequence[dict]:
    """Add algbw and busbw (GB/s) to every result that has a time."""
    factor = bus_factor(op, n)
    for row in rows:
        for res in row["results"].values():
            t = res.get("time_us")
            if t:
                res["algbw"] = row["size"] / (t * 1e-6) / 1e9
                res["busbw"] = res["algbw"] * factor
    return rows


def human_size(nbytes: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= div and nbytes % div == 0:
            return f"{nbytes // div} {unit}"
    return f"{nbytes} B"


def parse_size(text: str) -> int:
    """'4K', '16MiB', '1G' or plain bytes: a size in bytes (the scripts' --min/--max)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B").rstrip("I")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def size_range(low: str, high: str, factor: int = 2) -> list:
    """Sizes from parse_size(low) up to parse_size(high), each `factor` times the last."""
    sizes, size, top = [], parse_size(low), parse_size(high)
    while size <= top:
        sizes.append(size)
        size *= factor
    return sizes


def _cell(res: Optional[dict]) -> str:
    if not res or not res.get("time_us"):
        return f"{'-':>10} {'-':>7} {'-':>7}"
    return f"{res['time_us']:>10.1f} {res['algbw']:>7.2f} {res['busbw']:>7.2f}"


def _ratio(row: dict, a: str, b: str) -> str:
    ra, rb = row["results"].get(a, {}), row["results"].get(b, {})
    if not ra.get("busbw") or not rb.get("busbw"):
        return f"{'-':>9}"
    return f"{ra['busbw'] / rb['busbw']:>8.2f}x"


def format_table(rows: Sequence[dict], impls: Sequence[str], ratios: Iterable[tuple] = (),
                 title: str = "") -> str:
    """One line per size: size count type | per impl: time(us) algbw busbw | ratios."""
    ratios = list(ratios)
    head1 = f"{'':>10} {'':>10} {'':>8}" + "".join(f" | {name:^26}" for name in impls)
    head1 += "".join(f" {f'{a}/{b}':>9}" for a, b in ratios)
    head2 = f"{'size':>10} {'count':>10} {'type':>8}" + \
        "".join(f" | {'time(us)':>10} {'algbw':>7} {'busbw':>7}" for _ in impls)
    head2 += "".join(f" {'busbw':>9}" for _ in ratios)
    lines = [f"# {title}"] if title else []
    lines += ["#" + head1[1:], "#" + head2[1:]]
    for row in rows:
        line = f"{human_size(row['size']):>10} {row['count']:>10} {row['dtype']:>8}"
        line += "".join(f" | {_cell(row['results'].get(name))}" for name in impls)
        line += "".join(f" {_ratio(row, a, b)}" for a, b in ratios)
        lines.append(line)
    lines.append("# time: mean per op over the slowest rank; algbw, busbw in GB/s (nccl-tests definitions)")
    return "\n".join(lines)


def write_json(name: str, payload: dict, directory: str = RESULTS) -> str:
    """Write payload plus machine facts to directory/name-<utc time>.json; returns the path."""
    os.makedirs(directory, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = os.path.join(directory, f"{name}-{stamp}.json")
    meta = {"when": stamp, "machine": platform.machine(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "load_average": _load()}
    with open(path, "w") as f:
        json.dump({"meta": meta, **payload}, f, indent=1)
    return path


def _load():
    try:
        return os.getloadavg()
    except OSError:
        return None
