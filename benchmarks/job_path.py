"""Which of the package's files a training function's path touches, from run() to its result.

    python benchmarks/job_path.py [--np 2] [--local]

Every process of a real job (the driver, Spark's Python workers, the rank
processes) records each package file whose code runs, through a profile hook
that a sitecustomize on PYTHONPATH installs; the training function itself
calls nothing of the package, so what is counted is the machinery alone.
Files whose module or class bodies run but no function of theirs are
listed apart.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("horovod_spark", "collectives")

HOOK = r'''
import os, sys, threading
_log, _root, _seen = os.environ["HVS_PATH_LOG"], os.environ["HVS_PATH_ROOT"], set()
def _hook(frame, event, arg):
    if event != "call":
        return
    f = frame.f_code.co_filename
    kind = "call" if frame.f_code.co_flags & 1 else "import"  # CO_OPTIMIZED: a function
    if (kind, f) in _seen or not f.startswith(_root):
        return
    _seen.add((kind, f))
    with open(_log, "a") as out:
        out.write(f"{kind} {f}\n")
sys.setprofile(_hook)
threading.setprofile(_hook)
'''

JOB = r'''
import sys
from horovod_spark import run
def train():
    return 42
print(run(train, num_proc=NP, verbose=0))
'''


def measure(np_: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "sitecustomize.py"), "w") as f:
            f.write(HOOK)
        log = os.path.join(tmp, "files.log")
        env = dict(os.environ, HVS_PATH_LOG=log, HVS_PATH_ROOT=ROOT + os.sep,
                   PYTHONPATH=os.pathsep.join([tmp, ROOT, os.environ.get("PYTHONPATH", "")]),
                   HOROVOD_SPARK_WARM_START="0")
        out = subprocess.run([sys.executable, "-c", JOB.replace("NP", str(np_))], env=env,
                             capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise SystemExit(f"the job failed:\n{out.stderr[-3000:]}")
        called, imported = set(), set()
        for line in open(log):
            kind, path = line.split(" ", 1)
            rel = os.path.relpath(path.strip(), ROOT)
            if rel.split(os.sep)[0] in PACKAGES:
                (called if kind == "call" else imported).add(rel)
    return {"np": np_, "called": sorted(called), "imported_only": sorted(imported - called)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=2, help="ranks (negative: on the driver, no Spark)")
    p.add_argument("--json", help="write the result here too")
    args = p.parse_args()
    res = measure(args.np)
    for pkg in PACKAGES:
        files = [f for f in res["called"] if f.startswith(pkg + os.sep)]
        print(f"{pkg}: {len(files)} files whose code runs on the job's path")
        for f in files:
            print(f"  {f}")
    print(f"imported only (definitions, no call): {', '.join(res['imported_only']) or 'none'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
