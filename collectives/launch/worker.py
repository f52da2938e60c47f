"""The rank process `run_local` and the Spark task start.

It reads the rank environment, fetches the cloudpickled (fn, args, kwargs)
from the authenticated store, runs it, and writes back ("ok", value) or
("error", type, message, traceback, pickled exception).  It then leaves with
os._exit so no stray non-daemon thread of user code can hold the rank open.
"""
from __future__ import annotations

import os
import sys
import traceback

import cloudpickle

from .rankenv import RankEnv
from ..settings import WARM_REPORT
from ..rendezvous.store import TCPStore


def _error_record(exc: BaseException) -> tuple:
    try:
        blob = cloudpickle.dumps(exc)
    except Exception:
        blob = b""
    return ("error", type(exc).__name__, str(exc), traceback.format_exc(), blob)


def main() -> int:
    env = RankEnv.from_environ()
    if env is None:
        print("collectives.launch.worker: no rank environment (HVS_RANK ...); start ranks with "
              "collectives.launch or horovod_spark", file=sys.stderr)
        return 2
    store = TCPStore.connect(env.store_addr, env.secret)
    fn, args, kwargs = cloudpickle.loads(store.get(f"{env.job}/fn"))
    code = 0
    try:
        record = ("ok", fn(*args, **kwargs))
    except BaseException as exc:  # the driver gets every failure, SystemExit included
        record, code = _error_record(exc), 1
    try:
        data = cloudpickle.dumps(record)
    except Exception as exc:
        data = cloudpickle.dumps(("error", "PicklingError",
                                  f"the return value of rank {env.rank} cannot be pickled: {exc}",
                                  traceback.format_exc(), b""))
        code = 1
    report = WARM_REPORT.read()
    if report:  # which of these modules the function imported (the task's warm start)
        imported = [m for m in report.split(",") if m in sys.modules]
        store.set(f"{env.job}/modules/{env.rank}", ",".join(imported).encode("ascii"))
    store.set(f"{env.job}/result/{env.rank}", data)
    store.close()
    return code


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
