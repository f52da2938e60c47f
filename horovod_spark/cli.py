"""`horovod-spark run --np N [python] script.py [args]`: a script as every rank of a job.

The script's source is read on the driver and shipped with the job, so the
executors need not see the driver's files; each rank runs it as `__main__`
with `sys.argv = [script, *args]`.  The job runs on the active Spark master
(under `spark-submit`, or with `--master`), else on the embedded local
session; `--np -N` runs N ranks on this machine without Spark, and `--mpi`
hands the script to `mpiexec -n N` instead.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Optional, Sequence

from .script import ScriptMain, script_main

__all__ = ["main", "ScriptMain"]


_EXAMPLES = """\
examples:
  horovod-spark run --np 2 python train.py --epochs 3     2 Spark barrier tasks
  horovod-spark run --np -2 train.py                      2 local processes, no Spark
  horovod-spark run --np 8 --master spark://host:7077 --conf spark.task.cpus=2 train.py
  horovod-spark run --np 4 --mpi train.py                 through mpiexec -n 4
  horovod-spark run --np 8 --min-np 4 --reset-limit 3 train.py   elastic (hvd.elastic)
"""


def _parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(prog="horovod-spark", description="Distributed training on Spark.",
                                epilog=_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"horovod-spark {__version__}",
                   help="print the version and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           help="`horovod-spark run --help` lists its options")
    r = sub.add_parser("run", help="run a script as every rank of a job", epilog=_EXAMPLES,
                       description="Run a Python script as every rank of a job.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--np", "-np", type=int, required=True, metavar="N",
                   help="ranks: N > 0 as Spark barrier tasks, N < 0 as -N local processes on "
                        "this machine without Spark")
    r.add_argument("--master", metavar="URL",
                   help="Spark master URL (default: spark-submit's, else an embedded local[N])")
    r.add_argument("--remote", metavar="sc://HOST:PORT",
                   help="a Spark Connect server to run on (default: SPARK_REMOTE's, if set)")
    r.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                   help="a Spark setting for the session this command starts (repeatable)")
    r.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="add to every rank's environment (repeatable)")
    r.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="rerun every rank up to K times after a failure (default 0)")
    r.add_argument("--min-np", type=int, default=None, metavar="N",
                   help="elastic: run each attempt with at least N ranks (default: --np); any "
                        "of --min-np, --max-np, --reset-limit makes the job elastic "
                        "(docs/elastic.md)")
    r.add_argument("--max-np", type=int, default=None, metavar="N",
                   help="elastic: at most N ranks per attempt (default: --np)")
    r.add_argument("--reset-limit", type=int, default=None, metavar="K",
                   help="elastic: resume from the last commit up to K times after a lost rank "
                        "(default: no limit)")
    r.add_argument("--elastic-timeout", type=float, default=None, metavar="SECONDS",
                   help="elastic: seconds to wait for --min-np slots before a later attempt "
                        "(default: the start timeout)")
    r.add_argument("--start-timeout", type=float, default=None, metavar="SECONDS",
                   help="seconds to wait for executors to offer np task slots (default 600)")
    r.add_argument("--verbose", type=int, default=1, choices=(0, 1), metavar="{0,1}",
                   help="1: a progress bar while the job runs (default); 0: none")
    r.add_argument("--mpi", action="store_true",
                   help="run `mpiexec -n N python script.py args` instead of Spark tasks")
    r.add_argument("script", metavar="[python] script.py",
                   help="the script every rank runs as __main__ (a leading `python` is allowed)")
    r.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS",
                   help="the script's arguments (its sys.argv[1:])")
    return p


def _pairs(option: str, pairs: Sequence[str]) -> dict:
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise _Refused(f"{option} needs NAME=VALUE, got {pair!r}")
        out[name] = value
    return out


class _Refused(Exception):
    """A command line we refuse before anything starts: one line, exit status 2."""


def _script(ns) -> tuple:
    """The script and its arguments, with a leading interpreter (`python train.py`) dropped."""
    script, args = ns.script, list(ns.args)
    if _is_python(script):
        if args[:1] == ["-m"]:
            raise _Refused("`python -m MODULE` is not supported: give the script's path")
        if not args:
            raise _Refused(f"{script} needs a script: horovod-spark run --np N {script} train.py")
        script, args = args[0], args[1:]
    if not os.path.isfile(script) and (script.endswith(".py") or not ns.mpi):
        raise _Refused(f"no such script: {script} (from {os.getcwd()})")
    return script, args


def _is_python(word: str) -> bool:
    name = os.path.basename(word)
    return word == sys.executable or re.fullmatch(r"python[0-9.]*", name) is not None


def _session(master: Optional[str], np_: int, conf: dict, remote: Optional[str] = None):
    from ._job import get_session

    if master is None and remote is None:
        return get_session(np_, conf=conf)
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.remote(remote) if remote else \
        SparkSession.builder.master(master).appName("horovod-spark") \
        .config("spark.ui.showConsoleProgress", "false")  # the job's own bar shows progress
    for key, value in conf.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def _run(ns) -> int:
    from ._job import JobFailedError

    script, args = _script(ns)
    env, conf = _pairs("--env", ns.env), _pairs("--conf", ns.conf)
    if conf and (ns.np < 0 or ns.mpi):
        raise _Refused("--conf sets Spark settings, but " +
                       ("--mpi" if ns.mpi else f"--np {ns.np}") + " runs without Spark")
    elastic = any(v is not None for v in (ns.min_np, ns.max_np, ns.reset_limit,
                                          ns.elastic_timeout))
    if elastic and (ns.mpi or ns.max_restarts):
        raise _Refused(("--mpi runs one mpiexec job" if ns.mpi else "--max-restarts reruns a job "
                        "from its start") + "; --min-np, --max-np, --reset-limit and "
                       "--elastic-timeout make an elastic job, which resumes from its last "
                       "commit: pass one or the other")
    if ns.mpi:
        from ._job import run_mpi

        return run_mpi(abs(ns.np), script, args, env={**os.environ, **env})
    fn = script_main(script, args)
    if ns.np > 0:
        if ns.master and ns.remote:
            raise _Refused("--master and --remote name two different Spark sessions; pass one")
        _session(ns.master, max(ns.np, ns.max_np or 0), conf, ns.remote)
    try:
        _launch(ns, fn, env, elastic)
    except JobFailedError as exc:
        print(f"horovod-spark run: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a check before submitting: the text says what to change
        print(f"horovod-spark run: {exc}", file=sys.stderr)
        return 2
    return 0


def _launch(ns, fn, env: dict, elastic: bool) -> None:
    from . import runner

    if elastic:
        runner.run_elastic(fn, num_proc=ns.np, min_num_proc=ns.min_np, max_num_proc=ns.max_np,
                           reset_limit=ns.reset_limit, elastic_timeout=ns.elastic_timeout,
                           env=env, start_timeout=ns.start_timeout, verbose=ns.verbose)
    else:
        runner.run(fn, num_proc=ns.np, env=env, start_timeout=ns.start_timeout,
                   verbose=ns.verbose, max_restarts=ns.max_restarts)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The `horovod-spark` console script; returns the exit status."""
    ns = _parser().parse_args(argv)
    try:
        return _run(ns)
    except _Refused as exc:
        print(f"horovod-spark {ns.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
