"""The keeper: the parent every launcher gives a rank, so that nothing of the rank outlives it.

    python -S keeper.py PARENT_PID COMMAND [ARG ...]

Terms.  The *launcher* starts the keeper (the local launcher, a Spark task; a zygote
forks it and calls `keep`).  The keeper dies with the launcher (PR_SET_PDEATHSIG), is a
*child subreaper* (PR_SET_CHILD_SUBREAPER: a descendant of the rank whose parent
exits, such as a server started with setsid or a double-forked daemon, is re-parented
to the keeper, not to init) and forks the *rank*, which dies with the keeper and
becomes COMMAND.  What is *left* when the rank has exited is every process still
under the keeper: the keeper SIGKILLs them, round after round (a killed process's
children come to the keeper in turn), reaps them, removes the shared-memory segments
the rank created and could not unlink, and exits as the rank did: its exit status, or
its signal.  SIGTERM, SIGINT or SIGHUP to the keeper (the launcher's stop, the
launcher's death) SIGKILL the rank first, then the same.  The rank and what it starts
without a session of its own share the keeper's process group.

What no keeper can catch: a keeper killed by SIGKILL leaves the rank's detached
descendants to init, so launchers stop a keeper with SIGTERM and SIGKILL its process
group only when it has not exited within a few seconds.

Standard library only, run by path with `python -S`, so it starts in milliseconds.
"""
import ctypes
import glob
import os
import signal
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
#: Seconds the keeper goes on killing what is left before it gives up (a fork bomb).
SWEEP_S = 5.0
_STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _prctl(option: int, arg: int) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0)


def _children() -> list:
    """The pids whose parent is this process."""
    me = os.getpid()
    try:
        with open(f"/proc/{me}/task/{me}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:  # a kernel without CONFIG_PROC_CHILDREN
        pass
    found = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == me:
            found.append(int(stat.split("/")[2]))
    return found


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def sweep(rank: int) -> None:
    """Kill everything left under this keeper (the rank has exited); reap it all."""
    deadline = time.monotonic() + SWEEP_S
    while time.monotonic() < deadline:
        left = _children()
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.005)
        _reap()
    _reap()
    for path in glob.glob(f"/dev/shm/hvs-{rank}-*"):  # its segment, if it died sharing it
        try:
            os.unlink(path)
        except OSError:
            pass


def _exit_like(status: int) -> None:
    """Leave as the rank did: its exit status, or killed by its signal."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        _prctl(PR_SET_DUMPABLE, 0)  # no core file of the keeper's own
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL, SIGSTOP
            pass
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def keep(start) -> None:
    """Be the keeper of the rank `start()` forks (it returns the rank's pid); never returns.

    Call it in a process that has just become its own session, with PR_SET_PDEATHSIG set."""
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    rank = start()

    def stop(signum, frame):
        try:  # what it started comes to the keeper when it is gone
            os.kill(rank, signal.SIGKILL)
        except OSError:
            pass

    for sig in _STOPS:
        signal.signal(sig, stop)
    status = None
    while status is None:
        try:
            pid, st = os.waitpid(-1, 0)
        except ChildProcessError:
            st, pid = 1 << 8, rank
        if pid == rank:
            status = st
    sweep(rank)
    _exit_like(status)


def _exec_rank(argv: list) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            for sig in (*_STOPS, signal.SIGPIPE, signal.SIGXFSZ):  # as subprocess leaves them
                signal.signal(sig, signal.SIG_DFL)
            os.execvp(argv[0], argv)
        finally:
            os._exit(127)
    return pid


def main(argv: list) -> None:
    parent, command = int(argv[0]), argv[1:]
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the launcher died before PR_SET_PDEATHSIG took
        os._exit(70)
    keep(lambda: _exec_rank(command))


if __name__ == "__main__":
    main(sys.argv[1:])
