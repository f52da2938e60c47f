"""The rank process `run_local` and the Spark task start.

It reads the rank environment, takes the cloudpickled (fn, args, kwargs) from its
launcher on its own channel (`channel.RankEnd`), runs it, and sends back on that channel
its `RankResult`: the pickled value, or the failure with its traceback and pickled
exception.  Only the ranks in
HVS_RETURN_RANKS (unset: all; "0" under HorovodRunner) pickle their value: the
others' is thrown away, so it never travels and never fails the job.

Then it runs the exit handlers and ends with os._exit (see `leave`), bounded by
EXIT_GRACE_S: no stray non-daemon thread or exit handler of user code can hold the
rank open.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import traceback

import cloudpickle

from .channel import RankEnd
from .rankenv import RankEnv
from .record import Failure, RankResult
from ..settings import RETURN_RANKS
from ..settings import WARM_REPORT


#: Seconds the exit handlers may take after the result is stored.
EXIT_GRACE_S = 10.0


def describe_exception(exc: BaseException) -> str:
    """str(exc), or what can be said of an exception whose __str__ raises."""
    try:
        return str(exc)
    except Exception as broken:
        try:
            args = repr(exc.args)
        except Exception:
            args = "(unprintable)"
        return (f"<the exception's __str__ raised {type(broken).__name__}>; its args: {args}")


def user_traceback(exc: BaseException) -> str:
    """`exc`'s traceback without the launch's own frames around the job's function (this
    module's main and the wrappers that set `__tracebackhide__`, the convention pytest
    reads): it starts at the user's code.  A frame that raised is always kept."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None and (
            tb.tb_frame.f_code is main.__code__ or "__tracebackhide__" in tb.tb_frame.f_locals):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _failure(env: RankEnv, exc: BaseException) -> RankResult:
    try:
        blob = cloudpickle.dumps(exc)
    except BaseException:  # noqa: BLE001 - an exception that cannot be pickled is still named
        blob = b""
    try:
        tb = user_traceback(exc)
    except BaseException:  # noqa: BLE001
        tb = ""
    return RankResult(failure=Failure(env.rank, type(exc).__name__, describe_exception(exc),
                                      size=env.size, host=env.host, traceback=tb, exc_blob=blob))


class PayloadNotLoadable(RuntimeError):
    """The job's function or its arguments do not unpickle in the rank process."""


def _load(payload: bytes):
    """The job's (fn, args, kwargs); what fails to load here is named as such."""
    try:
        return cloudpickle.loads(payload)
    except Exception as exc:
        raise PayloadNotLoadable(
            f"the job's function or its arguments cannot be loaded in the rank process: "
            f"{type(exc).__name__}: {describe_exception(exc)} (a module the driver imports and "
            f"this machine lacks? install it on the executors, or have cloudpickle pickle "
            f"it by value)") from exc


def _returns_value(rank: int) -> bool:
    wanted = RETURN_RANKS.read()
    return wanted is None or str(rank) in wanted.split(",")


def _announce_if_never_joined(env: RankEnv) -> None:
    """A function that returned without init(): say so where the others wait for this rank
    (best effort, for at most ANNOUNCE_S: a store that is gone, as rank 0's task store once
    rank 0's function returned, leaves them to their timeout, as before, and this rank's
    result does not wait for it)."""
    import threading

    import collectives

    if collectives.joined():
        return
    from collectives.rendezvous.mesh import announce_returned
    from collectives.rendezvous.store import TCPStore

    def announce() -> None:
        try:
            store = TCPStore.connect(env.store_addr, env.secret, ANNOUNCE_S)
            try:
                announce_returned(store, env.rank, f"{env.job}/comm0")
            finally:
                store.close()
        except Exception:  # noqa: BLE001 - the rank's own result matters more
            pass

    said = threading.Thread(target=announce, name="hvs-announce-returned", daemon=True)
    said.start()
    said.join(ANNOUNCE_S)


#: How long a rank that returned without init() tries to say so (`_announce_if_never_joined`).
ANNOUNCE_S = 2.0


def main() -> int:
    end = RankEnd.of_this_process()
    env = RankEnv.from_environ()
    if env is None or end is None:
        print("collectives.launch.worker: no rank environment (HVS_RANK ...) or no channel "
              "from a launcher (HVS_CHANNEL); start ranks with collectives.launch or "
              "horovod_spark", file=sys.stderr)
        return 2
    code = 0
    try:
        fn, args, kwargs = _load(end.payload())
        value = fn(*args, **kwargs)
        _announce_if_never_joined(env)
        try:
            result = RankResult(value_blob=cloudpickle.dumps(
                value if _returns_value(env.rank) else None))
        except Exception as exc:
            result = RankResult(failure=Failure(
                env.rank, "PicklingError", f"the return value of rank {env.rank} cannot be "
                f"pickled: {exc}", size=env.size, host=env.host, traceback=traceback.format_exc()))
            code = 1
        del value
    except BaseException as exc:  # the driver gets every failure, SystemExit included
        result, code = _failure(env, exc), 1
    report = WARM_REPORT.read()
    if report:  # which of these modules the function imported (the task's warm start)
        imported = [m for m in report.split(",") if m in sys.modules]
        end.report(",".join(imported).encode("ascii"))
    end.result(result.encode())
    return code


def leave(rc: int) -> None:
    """A failed rank leaves at once (its peers see it gone).  One that returned leaves as a
    multiprocessing child does: it waits for its non-daemon threads and runs the exit
    handlers (the adapters' hvd.shutdown(), which tells ranks still waiting in a collective
    that this one returned; the timeline's close; logging's flush), then ends with os._exit,
    all within EXIT_GRACE_S.  The interpreter's own teardown and C++ static destructors never
    run: torch 2.13 aborts in them after DDP about one exit in eight ("terminate called
    without an active exception", under torchrun too), which would fail a job whose result
    is already sent."""
    def cut():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)

    if rc != 0:
        cut()
    timer = threading.Timer(EXIT_GRACE_S, cut)
    timer.daemon = True
    timer.start()
    try:
        for thread in threading.enumerate():
            if not thread.daemon and thread is not threading.current_thread():
                thread.join()
        atexit._run_exitfuncs()
    finally:
        cut()


if __name__ == "__main__":
    leave(main())
