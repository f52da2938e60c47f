"""Code that runs inside the rank processes of the fault tests, faults included.

A *note* is a small JSON file `<outdir>/<what>.<rank>.json` a rank writes for
the test to read: its pid, the moment it was killed (written just before the
SIGKILL, so the test can measure how long the driver took to notice), the
error it raised.  A *victim* is the rank a fault is injected into; the other
ranks are *survivors*.  Every loop here is bounded by `seconds`, so a fault
that fails to fire ends the job normally (and the test fails) instead of
hanging it.

The module is pickled by value (see the bottom), because Spark's executors
cannot import it: the functions must not import this module by name.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import threading
import time

import cloudpickle
import numpy as np

def note(outdir, rank, what, **data):
    """Write <outdir>/<what>.<rank>.json atomically."""
    path = os.path.join(outdir, f"{what}.{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def _rank():
    return int(os.environ["HVS_RANK"])


def die_now(outdir, rank, where):
    """Note the moment (and any shared memory this rank created), then SIGKILL this process."""
    shm = sorted(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else []
    mine = [n for n in shm if n.startswith(f"hvs-{os.getpid()}-")]
    note(outdir, rank, "killed", t=time.time(), where=where, shm=mine)
    os.kill(os.getpid(), signal.SIGKILL)


def die_later(outdir, rank, delay, where):
    t = threading.Timer(delay, die_now, args=(outdir, rank, where))
    t.daemon = True
    t.start()


def guarded(outdir, body):
    """Run body(); note the error a survivor sees before re-raising it."""
    rank = _rank()
    note(outdir, rank, "pid", pid=os.getpid(), bind=os.environ.get("HVS_BIND_ADDR"),
         t=time.time())
    try:
        return body()
    except BaseException as exc:
        note(outdir, rank, "error", type=type(exc).__name__, message=str(exc), t=time.time())
        raise


# --------------------------------------------------------------------------- training loops

def _allreduce_loop(comm, nelem, seconds):
    x = np.full(nelem, comm.rank + 1.0, np.float32)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        comm.allreduce(x)
    return "no fault fired"


def _fused_loop(hvd, nelem, tensors, seconds):
    import torch

    grads = [torch.full((nelem,), float(hvd.rank() + i), dtype=torch.float32)
             for i in range(tensors)]
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        handles = [hvd.allreduce_async(g, name=f"grad.{i}", op=hvd.Sum)
                   for i, g in enumerate(grads)]
        for h in handles:
            hvd.synchronize(h)
    return "no fault fired"


def train_and_die(outdir, victim, delay, mode="allreduce", nelem=4096, seconds=20.0):
    """Every rank trains; the victim SIGKILLs itself `delay` s after init().

    mode "allreduce": Communicator.allreduce in a loop; "fused": named async
    allreduces through horovod_spark.torch (the fusion engine).
    """
    def body():
        if mode == "fused":
            import horovod_spark.torch as hvd

            hvd.init()
            if hvd.rank() == victim:
                die_later(outdir, victim, delay, "hvd training")
            return _fused_loop(hvd, nelem, 8, seconds)
        import collectives

        comm = collectives.init()
        if comm.rank == victim:
            die_later(outdir, victim, delay, "allreduce")
        return _allreduce_loop(comm, nelem, seconds)

    return guarded(outdir, body)


def _communicator(cls):
    """What collectives.init() builds, as an instance of `cls` (a Communicator subclass)."""
    from collectives import Config, RankEnv
    from collectives.rendezvous.store import TCPStore

    renv = RankEnv.from_environ()
    store = TCPStore.connect(renv.store_addr, renv.secret, 30.0)
    return cls.create(store, renv.rank, renv.size, renv.host, renv.bind_addr, renv.secret,
                      f"{renv.job}/comm0", Config.create(env=os.environ))


def die_in_fused_allreduce(outdir, victim, nth, nelem=1 << 16, seconds=20.0):
    """The victim dies inside its nth fused allreduce, once every survivor is in it too.

    The fusion engine's executor calls the communicator (`allreduce_flat`) with a name
    of the form `fusion.<first tensor>+<others>` for a fused buffer; the victim's communicator
    waits 0.2 s there (the survivors enter the same collective) and SIGKILLs itself.
    """
    from collectives import Communicator

    rank = _rank()

    class DiesInFusedAllreduce(Communicator):
        calls = 0

        def allreduce_flat(self, src, dst, dtype, op, postscale=1.0, name=None, control=False):
            if name and name.startswith("fusion.") and "+" in name:
                DiesInFusedAllreduce.calls += 1
                if DiesInFusedAllreduce.calls == nth:
                    time.sleep(0.2)
                    die_now(outdir, rank, f"fused allreduce {name}")
            return super().allreduce_flat(src, dst, dtype, op, postscale, name, control)

    def body():
        import horovod_spark.torch as hvd

        hvd.init(comm=_communicator(DiesInFusedAllreduce if rank == victim else Communicator))
        return _fused_loop(hvd, nelem, 8, seconds)

    return guarded(outdir, body)


# --------------------------------------------------------------------------- rendezvous

def fault_store(base, hook):
    """A Store that calls hook(op, key, before) around every call to `base`."""
    from collectives.rendezvous.store import Store

    class FaultStore(Store):
        def _do(self, op, key, *args):
            hook(op, key, True)
            out = getattr(base, op)(key, *args)
            hook(op, key, False)
            return out

        def set(self, key, value):
            self._do("set", key, value)

        def get(self, key, timeout=None):
            return self._do("get", key, timeout)

        def add(self, key, amount):
            return self._do("add", key, amount)

        def check(self, key):
            return self._do("check", key)

        def delete(self, key):
            self._do("delete", key)

    return FaultStore()


def communicator_through(hook):
    """A Communicator bootstrapped over the launcher's store, with `hook` on every store call."""
    from collectives import Communicator, Config, RankEnv
    from collectives.rendezvous.store import TCPStore

    renv = RankEnv.from_environ()
    base = TCPStore.connect(renv.store_addr, renv.secret, 30.0)
    config = Config.create(env=os.environ)
    return Communicator.create(fault_store(base, hook), renv.rank, renv.size, renv.host,
                               renv.bind_addr, renv.secret, f"{renv.job}/fault", config)


#: Where a rank can die during rendezvous: (store op, key part, after the call?, delay s).
#: "after-creating-shared-memory": local rank 0 publishes the name, creates the segment and
#: dies 0.3 s later while it waits for the others, who come 0.8 s late to attach.
RENDEZVOUS_POINTS = {
    "before-init": None,                                          # never reaches the store
    "after-publishing-its-address": ("set", "/mesh/rank/", True, 0.0),
    "after-publishing-the-shm-name": ("set", "/native/shm/", True, 0.0),
    "after-creating-shared-memory": ("set", "/native/shm/", True, 0.3),
}


def start_together(outdir, size, timeout=120.0):
    """Wait (bounded) until every rank has noted its pid: the connect timeout under test
    then counts from a common start, not from each process's own start, which a loaded
    machine spreads over seconds (a rank seen late is not the fault these tests make)."""
    deadline = time.monotonic() + timeout
    while len(notes_of(outdir, "pid")) < size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {sorted(notes_of(outdir, 'pid'))} of {size} ranks started "
                               f"within {timeout:g} s")
        time.sleep(0.01)


def notes_of(outdir, what):
    return {int(n.split(".")[1]) for n in os.listdir(outdir)
            if n.startswith(what + ".") and n.endswith(".json")}


def rendezvous_and_die(outdir, victim, point):
    """The victim dies at `point` of bootstrap; the others bootstrap and allreduce once."""
    rank, late = _rank(), []

    def hook(op, key, before):
        where = RENDEZVOUS_POINTS[point]
        if rank == victim and op == where[0] and where[1] in key and before != where[2]:
            if where[3]:
                die_later(outdir, rank, where[3], point)
            else:
                die_now(outdir, rank, point)
        if (rank != victim and point == "after-creating-shared-memory" and op == "get"
                and "/native/shm/" in key and before and not late):
            late.append(time.sleep(0.8))

    def body():
        start_together(outdir, int(os.environ["HVS_SIZE"]))  # after guarded() noted the pid
        if point == "before-init" and rank == victim:
            die_now(outdir, rank, point)
        comm = communicator_through(hook)
        return float(comm.allreduce(np.ones(4, np.float32))[0])

    return guarded(outdir, body)


# --------------------------------------------------------------------------- stalls

def stall_in_fused(outdir, staller, at_step, steps=20):
    """Every rank submits named tensors each step; the staller sleeps at `at_step`."""
    def body():
        import horovod_spark.torch as hvd
        import torch

        hvd.init()
        for step in range(steps):
            if hvd.rank() == staller and step == at_step:
                note(outdir, staller, "stalled", t=time.time())
                time.sleep(3600)
            hs = [hvd.allreduce_async(torch.ones(64) * i, name=f"grad.{i}") for i in range(3)]
            for h in hs:
                hvd.synchronize(h)
        return "no stall"

    return guarded(outdir, _with_log_capture(outdir, body))


def _with_log_capture(outdir, body):
    """Keep this rank's collectives warnings in a note, whatever happens."""
    import logging

    def run():
        records = []

        class Keep(logging.Handler):
            def emit(self, record):
                records.append(record.getMessage())

        logging.getLogger("collectives").addHandler(Keep())
        try:
            return body()
        finally:
            note(outdir, _rank(), "warnings", lines=records)

    return run


def stall_in_allreduce(outdir, staller, at_step, freeze=False, steps=1000):
    """Plain Communicator allreduces; the staller sleeps (or SIGSTOPs itself) at `at_step`."""
    def body():
        import collectives

        comm = collectives.init()
        x = np.ones(1024, np.float32)
        for step in range(steps):
            if comm.rank == staller and step == at_step:
                note(outdir, staller, "stalled", t=time.time())
                if freeze:
                    os.kill(os.getpid(), signal.SIGSTOP)
                time.sleep(3600)
            comm.allreduce(x)
        return "no stall"

    return guarded(outdir, body)


# --------------------------------------------------------------------------- network faults

def reset_connections(keep_ports=()):
    """Abort every established TCP connection of this process with a RST.

    connect(AF_UNSPEC) disconnects a TCP socket the way SO_LINGER 0 + close()
    does (the peer gets ECONNRESET), but the descriptor stays open, so the
    native code that is using it gets an error instead of a reused fd.
    """
    import psutil

    libc = ctypes.CDLL(None, use_errno=True)
    unspec = (ctypes.c_ubyte * 16)()  # sockaddr with sa_family = AF_UNSPEC (0)
    done = 0
    for conn in psutil.Process().net_connections(kind="tcp"):
        if conn.status != psutil.CONN_ESTABLISHED or conn.raddr.port in keep_ports:
            continue
        libc.connect(conn.fd, unspec, 16)
        done += 1
    return done


def train_and_reset(outdir, victim, delay, seconds=20.0, nelem=1 << 18):
    """TCP ranks allreduce; the victim resets its mesh connections mid-transfer."""
    def body():
        import collectives

        comm = collectives.init()
        if comm.rank == victim:
            store_port = int(os.environ["HVS_STORE_ADDR"].rsplit(":", 1)[1])

            def reset():  # the note first: the rank may be gone right after the reset
                note(outdir, victim, "killed", t=time.time(), where="reset mesh connections")
                reset_connections(keep_ports=(store_port,))

            t = threading.Timer(delay, reset)
            t.daemon = True
            t.start()
        return _allreduce_loop(comm, nelem, seconds)

    return guarded(outdir, body)


def silent_rank0(outdir, seconds=60.0):
    """Rank 0 publishes a listener that accepts and never answers; the others bootstrap."""
    def body():
        import socket

        from collectives import RankEnv
        from collectives.rendezvous.store import TCPStore

        renv = RankEnv.from_environ()
        if renv.rank != 0:
            return communicator_through(lambda *a: None).rank
        store = TCPStore.connect(renv.store_addr, renv.secret)
        lst = socket.create_server((renv.bind_addr, 0))
        me = {"host": renv.host, "addr": renv.bind_addr, "port": lst.getsockname()[1],
              "pid": os.getpid(), "integrity": "control"}
        store.set(f"{renv.job}/fault/mesh/rank/0", json.dumps(me).encode())
        held, end = [], time.monotonic() + seconds
        lst.settimeout(0.5)
        while time.monotonic() < end:  # accept, hold, never say a word
            try:
                held.append(lst.accept()[0])
            except socket.timeout:
                pass
        return "silent"

    return guarded(outdir, body)


# --------------------------------------------------------------------------- listeners

def listeners(pid):
    """(ip, port) of every listening TCP socket of process `pid`."""
    import psutil

    return [list(c.laddr[:2]) for c in psutil.Process(pid).net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN]


def _launcher_pid() -> int:
    """The process that started this rank: its keeper's parent."""
    with open(f"/proc/{os.getppid()}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def held_bootstrap(outdir, held, wait_s=60.0):
    """Bootstrap, with the ranks in `held` stopped once they have read the mesh's plan.

    A held rank notes its own and its parent's listeners (its mesh listener is
    open then), and waits for the test's `go` file before it connects to its
    peers; the others go on accepting.  Then every rank allreduces rank+1 and
    notes the result.
    """
    rank = _rank()
    size = int(os.environ["HVS_SIZE"])

    def hook(op, key, before):
        if rank in held and op == "get" and not before and key.endswith("/mesh/plan"):
            note(outdir, rank, "listeners", own=listeners(os.getpid()),
                 parent=listeners(_launcher_pid()), bind=os.environ["HVS_BIND_ADDR"])
            end = time.monotonic() + wait_s
            while not os.path.exists(os.path.join(outdir, "go")) and time.monotonic() < end:
                time.sleep(0.02)

    def body():
        comm = communicator_through(hook)
        value = float(comm.allreduce(np.full(4, rank + 1.0, np.float32))[0])
        note(outdir, rank, "result", value=value)
        return value

    return guarded(outdir, body)


cloudpickle.register_pickle_by_value(__import__(__name__))
