"""Allreduce across the hosts of the emulated cluster, links shaped by tc.

    python benchmarks/cluster.py [--hosts 2,3,4] [--per-host 1,2] [--sizes-mib 1,4,16,64,256]
                                 [--rate 300mbit] [--delay 0.2ms] [--reps 3]
                                 [--impls ours,ours-serial,gloo,mpi]

Hosts are network namespaces (tests/cluster/_hosts.py; needs root), each link
shaped with netem at --rate and --delay on both of its ends (a host's uplink
and the switch port's downlink).  For every (hosts, ranks per host) the same
rank program (benchmarks/_cluster_rank.py) times an in-place float32
allreduce with this project's native backend (shared memory within a host,
TCP between hosts), torch.distributed's Gloo, and MPICH through mpi4py
(mpiexec in the head host, its proxies started in each host through nsenter
instead of ssh; UCX limited to TCP, since its shared-memory transports would
cross the namespaces of one kernel).  Prints nccl-tests-style tables and, per implementation, the
fraction of the link it used: the bytes each host's link carries each way (2(n-1)/n
of the buffer for a ring of all n ranks; 2(h-1)/h for ours, whose h host leaders
alone cross hosts) at the link rate, over the measured time; writes JSON under
benchmarks/results/.  ours-serial is ours without the pipelined hierarchical
allreduce (hier_chunk 0).
The default rate, 300 Mbit/s, is one that a 2-core machine can saturate with
8 ranks, so the tables measure the algorithms rather than the CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]

from _table import complete, format_table, write_json  # noqa: E402
from tests.cluster._hosts import Netns, unavailable  # noqa: E402

RANK = os.path.join(HERE, "_cluster_rank.py")


def _env(**extra) -> dict:
    keep = ("PATH", "HOME", "LANG")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1", **extra)
    return env


def _placement(hosts, per_host):
    """[(box, rank, local_rank, cross_rank)] in rank order: hosts filled one after another."""
    return [(h.box, c * per_host + i, i, c) for c, h in enumerate(hosts) for i in range(per_host)]


def _wait(procs, limit: float, what: str) -> None:
    deadline = time.monotonic() + limit
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError(f"{what} ran past {limit:.0f} s")
    bad = [p.returncode for p in procs if p.returncode]
    if bad:
        raise RuntimeError(f"{what}: ranks exited {bad}")


def run_ours(head, hosts, per_host, args, out, logs, impl="ours"):
    """The ranks meet at a store served in the first host (the launcher's part)."""
    secret = secrets.token_bytes(32)
    store_box = hosts[0].box
    # one per run: no wait for a port in TIME_WAIT
    port = 29400 + 10 * len(hosts) + per_host + 100 * (impl != "ours")
    server = store_box.spawn([sys.executable, "-c", (
        "import sys,time; from collectives.rendezvous.store import TCPStore; "
        f"s=TCPStore.serve(bind='{hosts[0].address}', port={port}, "
        f"secret=bytes.fromhex('{secret.hex()}')); time.sleep(3600)")], _env(), f"{logs}/store.log")
    try:
        time.sleep(1.0)
        procs, job = [], f"bench-{time.time_ns()}"
        size = len(hosts) * per_host
        for box, rank, local, cross in _placement(hosts, per_host):
            env = _env(HVS_RANK=str(rank), HVS_SIZE=str(size), HVS_LOCAL_RANK=str(local),
                       HVS_LOCAL_SIZE=str(per_host), HVS_CROSS_RANK=str(cross),
                       HVS_CROSS_SIZE=str(len(hosts)), HVS_HOST=box.host.address,
                       HVS_BIND_ADDR=box.host.address,
                       HVS_STORE_ADDR=f"{hosts[0].address}:{port}", HVS_SECRET=secret.hex(),
                       HVS_JOB=job, HOROVOD_SPARK_TIMEOUT="120")
            procs.append(box.spawn([sys.executable, RANK, impl, args.sizes, "1",
                                    str(args.reps), out], env, f"{logs}/{impl}-{rank}.log"))
        _wait(procs, args.limit, impl)
    finally:
        server.kill()
        server.wait()


def run_gloo(head, hosts, per_host, args, out, logs):
    procs = []
    size = len(hosts) * per_host
    master = f"{hosts[0].address}:{29500 + 10 * len(hosts) + per_host}"
    for box, rank, _, _ in _placement(hosts, per_host):
        env = _env(BENCH_RANK=str(rank), BENCH_SIZE=str(size), BENCH_MASTER=master,
                   GLOO_SOCKET_IFNAME="eth0")
        procs.append(box.spawn([sys.executable, RANK, "gloo", args.sizes, "1", str(args.reps),
                                out], env, f"{logs}/gloo-{rank}.log"))
    _wait(procs, args.limit, "gloo")


def run_mpi(head, hosts, per_host, args, out, logs):
    """mpiexec (hydra) in the head host; its 'ssh' is a script that enters the host."""
    if shutil.which("mpiexec") is None:
        raise RuntimeError("mpiexec is not installed")
    table = {b.name: b.holder.pid for h in hosts for b in h.boxes}
    enter = os.path.join(out, "enter-host.sh")
    with open(enter, "w") as f:  # hydra calls: <launcher-exec> [-x] HOST "command"
        f.write("#!/bin/sh\n[ \"$1\" = -x ] && shift\nhost=$1; shift\ncase $host in\n")
        for name, pid in table.items():
            f.write(f"  {name}) exec nsenter -t {pid} -n -m -u --wd={ROOT} sh -c \"$*\";;\n")
        f.write("esac\necho unknown host $host >&2; exit 1\n")
    os.chmod(enter, 0o755)
    hostlist = ",".join(f"{h.box.name}:{per_host}" for h in hosts)
    # UCX's shared-memory transports (SysV, CMA) see through network namespaces (one kernel,
    # one IPC namespace) and would bypass the shaped links: TCP only, as between machines.
    cmd = ["mpiexec", "-genv", "UCX_TLS", "tcp,self", "-launcher", "ssh",
           "-launcher-exec", enter, "-hosts", hostlist,
           "-n", str(len(hosts) * per_host), sys.executable, RANK, "mpi", args.sizes, "1",
           str(args.reps), out]
    proc = head.box.spawn(cmd, _env(), f"{logs}/mpi.log")
    _wait([proc], args.limit, "mpi")


def _tail(logs: str, impl: str) -> str:
    out = []
    for name in sorted(os.listdir(logs)):
        if name.startswith(impl):
            with open(os.path.join(logs, name), errors="replace") as f:
                out.append(f"## {name}: " + f.read()[-1500:])
    return "\n".join(out)


RUNNERS = {"ours": run_ours, "gloo": run_gloo, "mpi": run_mpi,
           "ours-serial": lambda *a: run_ours(*a, impl="ours-serial")}


def link_share(impl: str, hosts: int, size: int) -> float:
    """The part of the buffer each host's link carries each way: ours, 2(h-1)/h (only the
    h leaders' ring crosses hosts); a ring of all n ranks (Gloo), 2(n-1)/n."""
    n = hosts if impl.startswith("ours") else size
    return 2 * (n - 1) / n


def collect(out: str, impl: str, size: int, sizes) -> dict:
    per_rank = []
    for r in range(size):
        with open(os.path.join(out, f"{impl}-rank{r}.json")) as f:
            per_rank.append(json.load(f))
    result = {}
    for nbytes in sizes:
        reps = zip(*[rank[str(nbytes)] for rank in per_rank])
        slowest = [max(ts) for ts in reps]
        result[nbytes] = {"time_us": 1e6 * sum(slowest) / len(slowest)}
    return result


def sweep(netns, head, args, rate_gbps: float) -> list:
    sizes = [int(float(m) * (1 << 20)) for m in args.sizes_mib.split(",")]
    args.sizes = ",".join(map(str, sizes))
    blocks = []
    for nh in (int(h) for h in args.hosts.split(",")):
        for per_host in (int(p) for p in args.per_host.split(",")):
            hosts = netns.hosts[1:1 + nh]
            rows = [{"size": s, "count": s // 4, "dtype": "float32", "results": {}} for s in sizes]
            for impl in args.impls.split(","):
                out = tempfile.mkdtemp(prefix=f"hvs-bench-{impl}-", dir="/var/tmp")
                try:
                    RUNNERS[impl](head, hosts, per_host, args, out, netns.workdir)
                    got = collect(out, impl, nh * per_host, sizes)
                    for row in rows:
                        row["results"][impl] = got[row["size"]]
                except Exception as exc:  # one implementation failing keeps the others
                    print(f"# {impl} on {nh} hosts x {per_host}: {exc}\n{_tail(netns.workdir, impl)}",
                          file=sys.stderr)
                finally:
                    shutil.rmtree(out, ignore_errors=True)
            complete(rows, "allreduce", nh * per_host)
            for row in rows:
                for impl, res in row["results"].items():
                    if res.get("time_us"):  # bytes on each host's link over the link's rate
                        share = link_share(impl, nh, nh * per_host)
                        res["of_link"] = row["size"] * share * 8e-3 / res["time_us"] / rate_gbps
            title = (f"allreduce, {nh} hosts x {per_host} ranks, links {args.shaping}; "
                     f"of the link: " + ", ".join(
                         f"{impl} " + " ".join(f"{r['results'].get(impl, {}).get('of_link', 0):.3f}"
                                               for r in rows) for impl in args.impls.split(",")))
            impls = args.impls.split(",")
            pairs = [(a, b) for a, b in (("ours", "gloo"), ("ours", "ours-serial")) if {a, b} <= set(impls)]
            print(format_table(rows, impls, pairs, title), flush=True)
            blocks.append({"hosts": nh, "per_host": per_host, "rows": rows})
    return blocks


def _rate_gbps(rate: str) -> float:
    units = {"gbit": 1.0, "mbit": 1e-3}
    for u, f in units.items():
        if rate.endswith(u):
            return float(rate[:-len(u)]) * f
    raise ValueError(f"--rate: say it in gbit or mbit, got {rate}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", default="2,3,4")
    p.add_argument("--per-host", default="1,2")
    p.add_argument("--sizes-mib", default="1,4,16,64,256")
    p.add_argument("--rate", default="300mbit")
    p.add_argument("--delay", default="0.2ms")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--impls", default="ours,gloo,mpi")
    p.add_argument("--limit", type=float, default=600.0, help="seconds per run of one impl")
    args = p.parse_args()
    why = unavailable()
    if why:
        sys.exit(f"the emulated cluster is unavailable: {why}")
    workdir = tempfile.mkdtemp(prefix="hvs-bench-cluster-", dir="/var/tmp")
    netns = Netns(workdir)
    try:
        head = netns.add_host("head")
        for i in range(max(int(h) for h in args.hosts.split(","))):
            netns.add_host(f"h{i + 1}")
        args.shaping = netns.shape(args.rate, args.delay)
        print(f"# links: {args.shaping}", flush=True)
        blocks = sweep(netns, head, args, _rate_gbps(args.rate))
        path = write_json("cluster", {"args": vars(args), "blocks": blocks})
        print(f"# wrote {path}")
    finally:
        left = netns.close()
        shutil.rmtree(workdir, ignore_errors=True)
        if left:
            print(f"# teardown left {left}", file=sys.stderr)


if __name__ == "__main__":
    main()
