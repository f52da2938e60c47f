"""While a job runs, the driver JVM's loggers that would repeat a failed rank's error are off.

A failed rank fails its task with a message that carries its record (`HVS-FAILURE:` and
base64, for the driver to parse).  Spark's Executor (in the driver's JVM under a local
master) logs that message at ERROR with a JVM stack, and TaskSetManager at WARN, into the
user's notebook above the one JobFailedError that names the rank and shows its
traceback.  The embedded session configures both loggers off when it starts; a session
the user made has them off while a job runs and for LINGER_S after (a task of the
barrier stage that was still winding down logs its failure then), then back as they
were: a logger that had a level of its own gets it back, and one that inherited its
level (the usual case) inherits it again: its configuration made for the job is removed,
so Spark's console filter and a later `setLogLevel` treat it as before.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

__all__ = ["failure_logs_off"]

LINGER_S = 5.0
LOGGERS = ("org.apache.spark.executor.Executor", "org.apache.spark.scheduler.TaskSetManager")
_lock = threading.Lock()
_state = {"jobs": 0, "saved": {}}  # jobs running now; the levels their first one found


def _set_levels(sc, levels: dict) -> dict:
    """Set each logger's level (a name, e.g. "OFF"; None: inherit, its own configuration
    removed); returns what they had, in the same terms."""
    log4j = sc._jvm.org.apache.logging.log4j
    context = log4j.core.LoggerContext.getContext(False)
    config = context.getConfiguration()
    before = {}
    for name, level in levels.items():
        own = config.getLoggerConfig(name)
        before[name] = str(own.getLevel()) if own.getName() == name else None
        if level is None:
            config.removeLogger(name)
        else:
            log4j.core.config.Configurator.setLevel(name, log4j.Level.toLevel(level))
    context.updateLoggers()
    return before


@contextlib.contextmanager
def failure_logs_off(sc) -> Iterator[None]:
    """Spark's failure logs off in the driver JVM for the block and LINGER_S after (nestable).

    `sc` None (a Spark Connect client: the driver's JVM is the server's): nothing to turn off.
    """
    if sc is None:
        yield
        return
    with _lock:
        if not _state["saved"]:  # else still off from a job that ended within LINGER_S
            try:
                _state["saved"] = _set_levels(sc, dict.fromkeys(LOGGERS, "OFF"))
            except Exception:  # another logging backend: its logs stay as they are
                _state["saved"] = {}
        _state["jobs"] += 1
    try:
        yield
    finally:
        with _lock:
            _state["jobs"] -= 1
        timer = threading.Timer(LINGER_S, _restore, args=(sc,))
        timer.daemon = True
        timer.start()


def _restore(sc) -> None:
    with _lock:
        if _state["jobs"] == 0 and _state["saved"]:
            saved, _state["saved"] = _state["saved"], {}
            try:
                _set_levels(sc, saved)
            except Exception:  # the session stopped meanwhile
                pass
