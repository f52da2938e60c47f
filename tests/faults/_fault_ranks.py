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
import random
import signal
import threading
import time

import cloudpickle
import numpy as np

SOAK_DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64")


def note(outdir, rank, what, **data):
    """Write <outdir>/<what>.<rank>.json atomically."""
    path = os.path.join(outdir, f"{what}.{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def _rank():
    return int(os.environ["HVS_RANK"])


def die_now(outdir, rank, where):
    note(outdir, rank, "killed", t=time.time(), where=where)
    os.kill(os.getpid(), signal.SIGKILL)


def die_later(outdir, rank, delay, where):
    t = threading.Timer(delay, die_now, args=(outdir, rank, where))
    t.daemon = True
    t.start()


def guarded(outdir, body):
    """Run body(); note the error a survivor sees before re-raising it."""
    rank = _rank()
    note(outdir, rank, "pid", pid=os.getpid(), bind=os.environ.get("HVS_BIND_ADDR"))
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

    grads = [torch.full((nelem,), float(hvd.rank() + i), dtype=torch.float32) for i in range(tensors)]
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        handles = [hvd.allreduce_async(g, name=f"grad.{i}", op=hvd.Sum) for i, g in enumerate(grads)]
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
    from collectives.store import TCPStore

    renv = RankEnv.from_environ()
    store = TCPStore.connect(renv.store_addr, renv.secret, 30.0)
    return cls.create(store, renv.rank, renv.size, renv.host, renv.bind_addr, renv.secret,
                      f"{renv.job}/comm0", Config.create(env=os.environ))


def die_in_fused_allreduce(outdir, victim, nth, nelem=1 << 16, seconds=20.0):
    """The victim dies inside its nth fused allreduce, once every survivor is in it too.

    The fusion engine's executor calls the communicator with a name of the form
    `fusion.<first tensor>+<others>` for a fused buffer; the victim's communicator
    waits 0.2 s there (the survivors enter the same collective) and SIGKILLs itself.
    """
    from collectives import Communicator

    rank = _rank()

    class DiesInFusedAllreduce(Communicator):
        calls = 0

        def allreduce(self, x, *args, name=None, **kw):
            if name and name.startswith("fusion.") and "+" in name:
                DiesInFusedAllreduce.calls += 1
                if DiesInFusedAllreduce.calls == nth:
                    time.sleep(0.2)
                    die_now(outdir, rank, f"fused allreduce {name}")
            return super().allreduce(x, *args, name=name, **kw)

    def body():
        import horovod_spark.torch as hvd

        hvd.init(comm=_communicator(DiesInFusedAllreduce if rank == victim else Communicator))
        return _fused_loop(hvd, nelem, 8, seconds)

    return guarded(outdir, body)


# --------------------------------------------------------------------------- rendezvous

def fault_store(base, hook):
    """A Store that calls hook(op, key, before) around every call to `base`."""
    from collectives.store import Store

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
    from collectives.store import TCPStore

    renv = RankEnv.from_environ()
    base = TCPStore.connect(renv.store_addr, renv.secret, 30.0)
    config = Config.create(env=os.environ)
    return Communicator.create(fault_store(base, hook), renv.rank, renv.size, renv.host,
                               renv.bind_addr, renv.secret, f"{renv.job}/fault", config)


#: Where a rank can die during rendezvous: (store op, key part, before the call?).
RENDEZVOUS_POINTS = {
    "before-init": None,                              # never reaches the store
    "after-publishing-its-address": ("set", "/mesh/rank/", False),
    "after-creating-shared-memory": ("set", "/native/shm/", True),  # name not yet published
}


def rendezvous_and_die(outdir, victim, point):
    """The victim dies at `point` of bootstrap; the others bootstrap and allreduce once."""
    rank = _rank()

    def hook(op, key, before):
        where = RENDEZVOUS_POINTS[point]
        if rank == victim and (op, before) == (where[0], where[2]) and where[1] in key:
            die_now(outdir, rank, point)

    def body():
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
        from collectives.store import TCPStore

        renv = RankEnv.from_environ()
        if renv.rank != 0:
            return communicator_through(lambda *a: None).rank
        store = TCPStore.connect(renv.store_addr, renv.secret)
        lst = socket.create_server((renv.bind_addr, 0))
        me = {"host": renv.host, "addr": renv.bind_addr, "port": lst.getsockname()[1],
              "pid": os.getpid()}
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


def held_bootstrap(outdir, held, wait_s=60.0):
    """Bootstrap, with the ranks in `held` stopped once they have published their address.

    A held rank notes its own and its parent's listeners (its mesh listener is
    open then), and waits for the test's `go` file before it connects to its
    peers; the others go on accepting.  Then every rank allreduces rank+1 and
    notes the result.
    """
    rank = _rank()
    size = int(os.environ["HVS_SIZE"])

    def hook(op, key, before):
        if rank in held and op == "get" and not before and key.endswith(f"/mesh/rank/{size - 1}"):
            note(outdir, rank, "listeners", own=listeners(os.getpid()),
                 parent=listeners(os.getppid()), bind=os.environ["HVS_BIND_ADDR"])
            end = time.monotonic() + wait_s
            while not os.path.exists(os.path.join(outdir, "go")) and time.monotonic() < end:
                time.sleep(0.02)

    def body():
        comm = communicator_through(hook)
        value = float(comm.allreduce(np.full(4, rank + 1.0, np.float32))[0])
        note(outdir, rank, "result", value=value)
        return value

    return guarded(outdir, body)


# --------------------------------------------------------------------------- soak

def soak_shapes(seed, batch, max_elems):
    """(count, dtype) per tensor name: the first half of the names keep theirs for the
    whole soak (the engine's response cache serves them), the rest draw new ones."""
    rng = np.random.default_rng(seed)
    return [(int(rng.integers(0, max_elems + 1)), SOAK_DTYPES[int(rng.integers(len(SOAK_DTYPES)))])
            for _ in range(batch // 2)]


def soak_batch(rng, size, batch, max_elems, fixed):
    """One batch: (name, dtype name, every rank's values as float64) per tensor."""
    out = []
    for i in range(batch):
        if i < len(fixed):
            n, dt = fixed[i]
        else:
            n = int(rng.integers(0, max_elems + 1)) if rng.random() < 0.9 else int(rng.integers(0, 8))
            dt = SOAK_DTYPES[int(rng.integers(len(SOAK_DTYPES)))]
        low = 0 if dt == "uint8" else -4
        vals = rng.integers(low, 5, size=(size, n)).astype(np.float64)  # sums stay exact
        out.append((f"t{i}", dt, vals))
    return out


def soak(total, batch, seed, max_elems=4096):
    """`total` fused allreduces (SUM) through horovod_spark.torch, in batches.

    Every rank draws the same batches, so it knows the exact answer: integer
    values whose sums every dtype represents exactly.  Returns a digest of
    every result (equal on every rank iff the results are bit-identical), the
    number that differ from numpy, and the RSS after the first tenth and at
    the end.
    """
    import hashlib

    import horovod_spark.torch as hvd
    import psutil
    import torch

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    rng, digest, wrong, rss = np.random.default_rng(seed), hashlib.sha256(), 0, []
    batches, fixed = total // batch, soak_shapes(seed, batch, max_elems)
    for b in range(batches):
        items = soak_batch(rng, size, batch, max_elems, fixed)
        tensors = [torch.from_numpy(v[rank]).to(getattr(torch, dt)) for _, dt, v in items]
        handles = [hvd.allreduce_async(t, name=name, op=hvd.Sum)
                   for (name, _, _), t in zip(items, tensors)]
        for (_, dt, vals), h in zip(items, handles):
            out = hvd.synchronize(h)
            want = torch.from_numpy(vals.sum(axis=0)).to(getattr(torch, dt))
            wrong += int(out.dtype != want.dtype or not torch.equal(out, want))
            digest.update(out.view(torch.uint8).numpy().tobytes() if out.numel() else b"")
        if b == batches // 10 or b == batches - 1:
            rss.append(psutil.Process().memory_info().rss)
    hvd.shutdown()
    return {"digest": digest.hexdigest(), "wrong": wrong, "count": batches * batch, "rss": rss}


def soak_random_floats(steps, seed, nelem=1000):
    """Non-integer float32 sums: every rank must get the same bits; numpy within rounding."""
    import hashlib

    import horovod_spark.torch as hvd
    import torch

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    rng, digest, worst = np.random.default_rng(seed), hashlib.sha256(), 0.0
    for step in range(steps):
        vals = rng.standard_normal((size, nelem)).astype(np.float32)
        out = hvd.allreduce(torch.from_numpy(vals[rank].copy()), name=f"f{step % 7}", op=hvd.Sum)
        digest.update(out.numpy().tobytes())
        worst = max(worst, float(np.abs(out.numpy() - vals.astype(np.float64).sum(0)).max()))
    hvd.shutdown()
    return {"digest": digest.hexdigest(), "worst": worst}


# --------------------------------------------------------------------------- restarts

def _epoch_data(epoch, rank, size, steps, batch):
    g = np.random.default_rng(1000 + epoch)
    x = g.standard_normal((size * steps * batch, 8)).astype(np.float32)
    w = np.arange(1, 9, dtype=np.float32)
    y = (x @ w + 0.5).reshape(-1, 1).astype(np.float32)
    mine = slice(rank * steps * batch, (rank + 1) * steps * batch)
    return x[mine], y[mine]


def train_with_checkpoints(ckpt_dir, epochs=4, steps=6, batch=16, die_rank=None, die_epoch=1,
                           die_step=3):
    """Horovod-style training that checkpoints every epoch and resumes from the newest.

    Rank 0 writes `ckpt_dir/ckpt.pt` (model, optimizer, next epoch) at the end of each
    epoch and loads it at start; broadcasts bring every rank to it.  `die_rank`
    SIGKILLs itself once (a marker file remembers) in epoch `die_epoch`.
    Returns the final weights (numpy) and the epoch this attempt started at.
    """
    import horovod_spark.torch as hvd
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    hvd.init()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    path, start = os.path.join(ckpt_dir, "ckpt.pt"), 0
    if hvd.rank() == 0 and os.path.exists(path):
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["epoch"])
    start = hvd.broadcast_object(start, root_rank=0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    dopt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    marker = os.path.join(ckpt_dir, "died-once")
    for epoch in range(start, epochs):
        x, y = _epoch_data(epoch, hvd.rank(), hvd.size(), steps, batch)
        for step in range(steps):
            if (hvd.rank() == die_rank and epoch == die_epoch and step == die_step
                    and not os.path.exists(marker)):
                open(marker, "w").close()
                die_now(ckpt_dir, hvd.rank(), f"epoch {epoch} step {step}")
            xb = torch.from_numpy(x[step * batch:(step + 1) * batch])
            yb = torch.from_numpy(y[step * batch:(step + 1) * batch])
            dopt.zero_grad()
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            dopt.step()
        if hvd.rank() == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch + 1},
                       path + ".tmp")
            os.replace(path + ".tmp", path)
        hvd.barrier()
    weights = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    hvd.shutdown()
    return {"weights": weights, "started_at": start}


def random_delay(seed, low, high):
    return random.Random(seed).uniform(low, high)


cloudpickle.register_pickle_by_value(__import__(__name__))
