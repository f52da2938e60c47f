"""`horovod-spark run --np N script.py [args]`: a script as every rank of a job.

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
import sys
import types
from typing import Optional, Sequence

__all__ = ["main", "ScriptMain"]


class ScriptMain:
    """A picklable callable that runs a script's source as `__main__`."""

    def __init__(self, path: str, source: str, argv: Sequence[str]) -> None:
        self.path, self.source, self.argv = path, source, list(argv)

    def __call__(self) -> None:
        code = compile(self.source, self.path, "exec")
        module = types.ModuleType("__main__")
        module.__file__ = self.path
        saved = sys.argv, sys.modules.get("__main__")
        sys.argv = [self.path, *self.argv]
        here = os.path.dirname(os.path.abspath(self.path))
        if os.path.isdir(here) and here not in sys.path:
            sys.path.insert(0, here)  # sibling modules, where the executor has the same tree
        sys.modules["__main__"] = module
        try:
            exec(code, module.__dict__)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise
        finally:
            sys.argv = saved[0]
            if saved[1] is not None:
                sys.modules["__main__"] = saved[1]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="horovod-spark", description="Distributed training on Spark.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run a script as every rank of a job")
    r.add_argument("--np", "-np", type=int, required=True,
                   help="ranks: > 0 as Spark barrier tasks, < 0 as local processes on this machine")
    r.add_argument("--master", help="Spark master URL (default: the active one, or local[N])")
    r.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="add to every rank's environment (repeatable)")
    r.add_argument("--max-restarts", type=int, default=0, help="rerun every rank after a failure")
    r.add_argument("--start-timeout", type=float, default=None,
                   help="seconds to wait for executors to offer np slots")
    r.add_argument("--verbose", type=int, default=1)
    r.add_argument("--mpi", action="store_true",
                   help="run `mpiexec -n N python script.py args` instead of Spark tasks")
    r.add_argument("script")
    r.add_argument("args", nargs=argparse.REMAINDER)
    return p


def _env(pairs: Sequence[str]) -> dict:
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"horovod-spark run: --env needs NAME=VALUE, got {pair!r}")
        out[name] = value
    return out


def _session(master: Optional[str], np_: int):
    from ._job.session import get_session

    if master is None:
        return get_session(np_)
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    return SparkSession.builder.master(master).appName("horovod-spark").getOrCreate()


def _run(ns) -> int:
    from . import runner
    from ._job.driver import JobFailedError

    if ns.mpi:
        from ._job.mpirun import run_mpi

        return run_mpi(abs(ns.np), ns.script, ns.args, env={**os.environ, **_env(ns.env)})
    with open(ns.script, encoding="utf-8") as f:
        fn = ScriptMain(ns.script, f.read(), ns.args)
    if ns.np > 0:
        _session(ns.master, ns.np)
    try:
        runner.run(fn, num_proc=ns.np, env=_env(ns.env), start_timeout=ns.start_timeout,
                   verbose=ns.verbose, max_restarts=ns.max_restarts)
    except JobFailedError as exc:
        print(f"horovod-spark run: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a check before submitting: the text says what to change
        print(f"horovod-spark run: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    ns = _parser().parse_args(argv)
    if ns.command == "run":
        return _run(ns)
    return 2


if __name__ == "__main__":
    sys.exit(main())
