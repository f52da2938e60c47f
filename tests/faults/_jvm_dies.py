"""A driver whose Spark JVM is SIGKILLed while a job runs; prints what run() raised.

    python _jvm_dies.py OUTDIR

The job's ranks note their pids and sleep; once both ranks are up, the JVM
(this process's java child) is killed.  The last line printed is
`RAISED <type>: <first line of the message>`.
"""
from __future__ import annotations

import glob
import os
import sys
import threading
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _default_ranks as ranks  # noqa: E402


def kill_jvm_when_ranks_are_up(outdir: str) -> None:
    deadline = time.monotonic() + 120
    while len(glob.glob(os.path.join(outdir, "pid.*.json"))) < 2:
        if time.monotonic() > deadline:
            return
        time.sleep(0.1)
    for child in psutil.Process().children(recursive=True):
        if child.name() == "java":
            child.kill()


def main() -> None:
    import horovod_spark
    from horovod_spark._job.session import get_session

    outdir = sys.argv[1]
    get_session(2)
    threading.Thread(target=kill_jvm_when_ranks_are_up, args=(outdir,), daemon=True).start()
    try:
        horovod_spark.run(ranks.sleeps, args=(outdir, 60.0), num_proc=2, verbose=0,
                          env={"HOROVOD_SPARK_WARM_START": "0"})
        print("RAISED nothing", flush=True)
    except BaseException as exc:
        print(f"RAISED {type(exc).__name__}: {str(exc).splitlines()[0]}", flush=True)
    os._exit(0)  # the context's own exit handlers talk to the dead JVM


if __name__ == "__main__":
    main()
