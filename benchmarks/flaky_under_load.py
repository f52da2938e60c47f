"""The tests that were flaky, run again and again under a busy loop on every core.

    python benchmarks/flaky_under_load.py               # each set 30 times
    python benchmarks/flaky_under_load.py --runs 5 --sets negotiation

Sets (issue 38's three): `blame`, the ranks killed during rendezvous (the survivors and the
driver must name the dead rank, whatever the point); `stall`, a rank SIGSTOPped in a plain
allreduce over shared memory and TCP (the others fail at the timeout naming it); and
`negotiation`, the fusion engine's count of negotiations for names seen before.  Each run is
one pytest process; the load is one `while True` process per core, started before and
killed (by pid) after.  Prints runs and failures per set, with the first failure's tail.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SETS = {
    "blame": ["tests/faults/test_kill.py", "-k", "rendezvous"],
    "stall": ["tests/faults/test_stall.py", "-k", "plain_allreduce_fails_the_others"],
    "negotiation": ["tests/fusion/test_fusion_engine.py::test_names_seen_before_need_no_negotiation"],
}
BUSY = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--sets", default=",".join(SETS))
    p.add_argument("--busy", type=int, default=os.cpu_count() or 2, help="busy processes")
    args = p.parse_args()
    names = args.sets.split(",")
    # bounded: the busy loops end by themselves after the longest the runs could take
    busy = [subprocess.Popen([sys.executable, "-c", BUSY.format(seconds=args.runs * 120 * len(names))])
            for _ in range(args.busy)]
    began = time.perf_counter()
    print(f"# {args.runs} runs of each set under {args.busy} busy loop(s) on "
          f"{os.cpu_count()} cores", flush=True)
    print(f"# {'set':>12} {'runs':>5} {'failed':>7} {'s/run':>6}", flush=True)
    failures = {}
    try:
        for name in names:
            failed, t0 = 0, time.perf_counter()
            for _ in range(args.runs):
                done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p",
                                       "no:cacheprovider", "-o", "addopts=", *SETS[name]],
                                      cwd=ROOT, capture_output=True, text=True, timeout=900)
                if done.returncode != 0:
                    failed += 1
                    failures.setdefault(name, done.stdout[-3000:])
            print(f"  {name:>12} {args.runs:>5} {failed:>7} "
                  f"{(time.perf_counter() - t0) / args.runs:>6.1f}", flush=True)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    for name, tail in failures.items():
        print(f"# first failure of {name}:\n{tail}")
    print(f"# {time.perf_counter() - began:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
