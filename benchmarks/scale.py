"""How a job's costs grow with the world: real ranks to 64, simulated ranks to 4,096.

    python benchmarks/scale.py --real 2,4,8,16,32,64 [--per-host 4] [--tcp]
    python benchmarks/scale.py --simulate 128,256,512,1024,2048,4096 [--workers 4]

Real (`--real`): N collectives-only rank processes on this machine (no torch: its memory
would not fit 64 of them), started by the local launcher, whose store stands for the
driver's; with `--per-host P` every P ranks are a host of their own (fake hosts: shared
memory within, TCP between the host leaders), with `--tcp` every rank is.  Per N:

  bootstrap   collectives.init() (the store exchange, the mesh, shared memory), slowest rank
  first op    the first 8-byte allreduce after it
  cycle       one fused step in steady state: 16 named 1 KiB allreduces through the fusion
              engine (its negotiation is a cached bit vector), per step
  links       TCP connections this rank holds after init (its mesh), most and mean
  driver      the store's requests, bytes and connections during the job
  lines/s     every rank prints 2,000 lines; the launcher's rate of taking them in
  detect      a rank SIGKILLed in a loop of allreduces: seconds until the launcher raises

Simulated (`--simulate`): N ranks as threads in `--workers` processes, each running the
real control plane against a real store and a real log server in this process (the
driver): the bootstrap's store phase (`collectives.rendezvous.mesh.exchange`, with the
listening address a rank would publish), then the log channel (hello, 20 lines, done).
What the driver serves is counted exactly; the times are this 2-core machine's, which
runs the driver and every simulated rank at once, so read them for their growth.  The
mesh's links per leader come from the plan the real ranks use (`plan.link_peers`).

Each table ends with the fitted growth, the exponent b of cost = a * N^b (least squares on
the logs). JSON goes to benchmarks/results/.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from _table import write_json  # noqa: E402

LINES = 2000
SIM_LINES = 20


# -- real ranks --------------------------------------------------------------------------
def _sockets() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


def _real_rank(lines: int, steps: int):
    import numpy as np

    import collectives
    from collectives.fusion import FusionEngine

    before = _sockets()
    t = time.perf_counter()
    comm = collectives.init()
    boot = time.perf_counter() - t
    links = _sockets() - before - 1  # less the store's connection
    x = np.ones(1)
    t = time.perf_counter()
    comm.allreduce(x, out=x)
    first = time.perf_counter() - t
    engine = FusionEngine(comm)
    tensors = [np.ones(256, np.float32) for _ in range(16)]

    def step():
        handles = [engine.submit(f"t{i}", "allreduce", b, out=b) for i, b in enumerate(tensors)]
        for h in handles:
            h.wait()

    for _ in range(5):
        step()
    engine.submit("sync", "barrier").wait()  # (the engine's thread owns the communicator now)
    t = time.perf_counter()
    for _ in range(steps):
        step()
    cycle = (time.perf_counter() - t) / steps
    engine.shutdown()
    comm.barrier()
    for i in range(lines):
        print(f"rank {comm.rank} line {i}", flush=False)
    sys.stdout.flush()
    out = {"boot": boot, "first": first, "cycle": cycle, "links": links,
           "sent": comm.transport_metrics().get("tcp_bytes_sent", 0)}
    comm.close()
    return out


def _killed_rank(victim: int):
    import numpy as np

    import collectives

    comm = collectives.init()
    x = np.ones(1024)
    deadline = time.monotonic() + 60
    n = 0
    while time.monotonic() < deadline:
        comm.allreduce(x, out=x)
        n += 1
        if n == 200 and comm.rank == victim:
            with open(os.environ["SCALE_KILL_NOTE"], "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
    return n


class _Counting:
    """A stream that counts the lines written to it and when the last came."""

    def __init__(self) -> None:
        self.lines, self.first, self.last = 0, None, None
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            n = text.count("\n")
            if n:
                now = time.monotonic()
                self.first = self.first or now
                self.last = now
                self.lines += n
        return len(text)

    def flush(self) -> None:
        pass


def _launch(fn, n: int, args: tuple, env: dict, hosts, sink):
    import cloudpickle

    from collectives.launch.launcher import start_ranks

    blob = cloudpickle.dumps((fn, args, {}))
    group, server = start_ranks([sys.executable, "-m", "collectives.launch.worker"], n, env,
                                hosts, sink, sink, payload=blob)
    with group:
        values = group.wait_results(600, 60)
    return values, dict(server.stats)


def real(sizes, per_host: int, tcp: bool, steps: int) -> list:
    rows = []
    for n in sizes:
        env = {"HOROVOD_SPARK_FORCE_TCP": "1"} if tcp else {}
        hosts = [f"h{r // per_host}" for r in range(n)] if per_host else None
        sink = _Counting()
        values, store = _launch(_real_rank, n, (LINES, steps), env, hosts, sink)
        rate = sink.lines / max(sink.last - sink.first, 1e-9) if sink.lines > 1 else 0.0
        detect = _detect(n, env, hosts)
        row = {"n": n, "boot_s": max(v["boot"] for v in values),
               "first_us": max(v["first"] for v in values) * 1e6,
               "cycle_us": max(v["cycle"] for v in values) * 1e6,
               "links_max": max(v["links"] for v in values),
               "links_mean": sum(v["links"] for v in values) / n,
               "store_requests": store["requests"], "store_bytes": store["bytes_in"] +
               store["bytes_out"], "store_connections": store["connections"],
               "lines_per_s": rate, "detect_s": detect}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _detect(n: int, env: dict, hosts) -> float:
    import tempfile

    from collectives.launch import RankFailed

    with tempfile.TemporaryDirectory() as tmp:
        note = os.path.join(tmp, "killed")
        try:
            _launch(_killed_rank, n, (n - 1,), dict(env, SCALE_KILL_NOTE=note), hosts, _Counting())
        except RankFailed:
            raised = time.time()
        else:
            return float("nan")
        with open(note) as f:
            return raised - float(f.read())


# -- simulated ranks ---------------------------------------------------------------------
def _sim_worker(spec: dict) -> dict:
    """One worker process: its share of the simulated ranks, a thread each."""
    threading.stack_size(256 * 1024)
    from collectives.rendezvous import mesh, plan
    from collectives.rendezvous.store import TCPStore
    from horovod_spark._job import LogClient

    secret, key = bytes.fromhex(spec["secret"]), bytes.fromhex(spec["key"])
    n, times, errors = spec["n"], {}, []
    lock = threading.Lock()

    world = [f"h{q // spec['per_host']}" for q in range(n)]  # the launcher's placement
    digest = plan.map_digest(world)

    def rank(r: int) -> None:
        try:
            t0 = time.monotonic()
            store = TCPStore.connect(spec["store"], secret, 600)
            entry = {"host": world[r], "addr": "127.0.0.1", "port": 10000 + r,
                     "pid": os.getpid(), "shm": "shm", "integrity": "control", "tcp": False,
                     "map": digest}
            mesh.exchange(store, r, n, entry, spec["prefix"], 600, world)
            store.close()
            t1 = time.monotonic()
            log = LogClient(spec["log"], key, spec["job"], r, connect_timeout=600)
            for i in range(SIM_LINES):
                log.line("stdout", f"rank {r} line {i}")
            log.close(timeout=600)
            if log.error is not None or log.dropped:
                raise RuntimeError(f"log channel: {log.dropped} lines dropped ({log.error!r})")
            t2 = time.monotonic()
            with lock:
                times[r] = (t0, t1, t2)
        except Exception as exc:  # the driver reports it
            with lock:
                errors.append(f"rank {r}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=rank, args=(r,), daemon=True)
               for r in range(spec["worker"], n, spec["workers"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"times": times, "errors": errors}


def simulate(sizes, workers: int, per_host: int) -> list:
    from collectives.rendezvous import plan
    from collectives.rendezvous.store import StoreServer
    from horovod_spark._job import LineSink, LogServer

    rows = []
    for n in sizes:
        secret, key = os.urandom(32), os.urandom(32)
        store = StoreServer("127.0.0.1", 0, secret)
        sink_out = _Counting()
        server = LogServer("127.0.0.1", key, "sim/a0", LineSink(sink_out, sink_out))
        spec = {"n": n, "secret": secret.hex(), "key": key.hex(), "store": store.address,
                "log": server.address, "job": "sim/a0", "prefix": "sim/a0/comm0",
                "workers": workers, "per_host": per_host}
        procs = [subprocess.Popen([sys.executable, __file__, "--sim-worker",
                                   json.dumps(dict(spec, worker=w))], stdout=subprocess.PIPE,
                                  text=True) for w in range(workers)]
        results = [json.loads(p.communicate(timeout=1800)[0]) for p in procs]
        if not server.wait_done(range(n), 600):
            raise RuntimeError(f"the log server heard done from fewer than {n} simulated ranks")
        errors = [e for res in results for e in res["errors"]]
        if errors:
            raise RuntimeError(f"{len(errors)} simulated ranks failed, first: {errors[0]}")
        times = [t for res in results for t in res["times"].values()]
        start, store_end = min(t[0] for t in times), max(t[1] for t in times)
        log_start, log_end = min(t[1] for t in times), max(t[2] for t in times)
        stats = dict(store.stats)
        groups = [f"h{q // per_host}" for q in range(n)]
        leaders = plan.leaders_of(groups)
        per_rank = [len(plan.link_peers(r, groups, leaders)) for r in leaders]
        row = {"n": n, "store_s": store_end - start, "store_requests": stats["requests"],
               "store_bytes": stats["bytes_in"] + stats["bytes_out"],
               "store_connections": stats["connections"],
               "store_peak_connections": stats["peak_connections"],
               "log_s": log_end - log_start, "log_lines": sink_out.lines,
               "log_connections": n, "links_max": max(per_rank),
               "links_mean": sum(per_rank) / len(per_rank)}
        server.close()
        store.close()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


# -- tables ------------------------------------------------------------------------------
def growth(rows, key: str) -> str:
    pts = [(math.log(r["n"]), math.log(r[key])) for r in rows if r.get(key, 0) > 0]
    if len(pts) < 2:
        return "-"
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return f"N^{sum((p[0] - mx) * (p[1] - my) for p in pts) / den:.2f}" if den else "-"


def table(rows, columns) -> str:
    head = "| N | " + " | ".join(title for _, title, _ in columns) + " |"
    out = [head, "| ---: | " + " | ".join("---:" for _ in columns) + " |"]
    for r in rows:
        out.append(f"| {r['n']} | " + " | ".join(fmt.format(r[k]) for k, _, fmt in columns) + " |")
    out.append("| growth | " + " | ".join(growth(rows, k) for k, _, _ in columns) + " |")
    return "\n".join(out)


REAL_COLUMNS = [("boot_s", "bootstrap s", "{:.3f}"), ("first_us", "first op us", "{:.0f}"),
                ("cycle_us", "fused step us", "{:.0f}"), ("links_max", "links max", "{}"),
                ("links_mean", "links mean", "{:.1f}"), ("store_requests", "store requests", "{}"),
                ("store_bytes", "store bytes", "{}"), ("store_connections", "store conns", "{}"),
                ("lines_per_s", "lines/s", "{:,.0f}"), ("detect_s", "detect s", "{:.2f}")]
SIM_COLUMNS = [("store_s", "store phase s", "{:.2f}"), ("store_requests", "store requests", "{}"),
               ("store_bytes", "store bytes", "{:,}"), ("store_connections", "store conns", "{}"),
               ("store_peak_connections", "peak conns", "{}"), ("log_s", "log phase s", "{:.2f}"),
               ("log_lines", "lines", "{}"), ("links_max", "links max", "{}"),
               ("links_mean", "links mean", "{:.1f}")]


def main() -> None:
    if sys.argv[1:2] == ["--sim-worker"]:
        print(json.dumps(_sim_worker(json.loads(sys.argv[2]))))
        return
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--real", help="world sizes of real ranks, comma-separated")
    ap.add_argument("--simulate", help="world sizes of simulated ranks, comma-separated")
    ap.add_argument("--per-host", type=int, default=0,
                    help="ranks per (fake) host; 0: one host (real), 8 (simulated)")
    ap.add_argument("--tcp", action="store_true", help="real ranks: every rank a host")
    ap.add_argument("--workers", type=int, default=4, help="processes of simulated ranks")
    ap.add_argument("--steps", type=int, default=50, help="fused steps timed per real rank")
    args = ap.parse_args()
    out = {}
    if args.real:
        rows = real([int(x) for x in args.real.split(",")], args.per_host, args.tcp, args.steps)
        where = "every rank a host" if args.tcp else f"{args.per_host or 'all'} a host"
        print(f"\nreal ranks ({where})")
        print(table(rows, REAL_COLUMNS))
        out["real"] = rows
    if args.simulate:
        rows = simulate([int(x) for x in args.simulate.split(",")], args.workers,
                        args.per_host or 8)
        print(f"\nsimulated ranks ({args.per_host or 8} a host)")
        print(table(rows, SIM_COLUMNS))
        out["simulated"] = rows
    print(write_json("scale", out))


if __name__ == "__main__":
    main()
