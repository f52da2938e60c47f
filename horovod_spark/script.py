"""A script as a job's function: its source, shipped with the job, run as `__main__`.

The source is read where the job starts, so executors need not see the driver's files;
each rank runs it with `sys.argv = [script, *args]`.  The CLI (`horovod-spark run`) and
`TorchDistributor.run("train.py", ...)` both run scripts this way.
"""
from __future__ import annotations

import os
import sys
import types
from typing import Sequence

__all__ = ["ScriptMain", "script_main"]


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


def script_main(path: str, argv: Sequence[str]) -> ScriptMain:
    """The script at `path`, read now, to run with `argv` as its arguments."""
    with open(path, encoding="utf-8") as f:
        return ScriptMain(path, f.read(), argv)
