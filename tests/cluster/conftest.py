"""The emulated cluster: a head host (Master, driver programs) and three worker hosts.

Built once per session (its start-up is printed), torn down on every exit; the
tests skip, with the reason, where the machine cannot make network namespaces.
"""
import os
import shutil
import sys
import tempfile
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _hosts import Netns, unavailable  # noqa: E402
from _standalone import Standalone  # noqa: E402

WORKERS = ("h1", "h2", "h3")
# per Worker: room for two apps of 2-core executors at once (a module may hold an app of 2
# executors and one of 3); the Master spreads an app's executors one per Worker
CORES = 4


class Cluster:
    def __init__(self, netns: Netns, spark: Standalone, workdir: str) -> None:
        self.netns, self.spark, self.workdir = netns, spark, workdir
        self.head = netns.hosts[0]
        self.workers = list(netns.hosts[1:])

    def scratch(self, name: str) -> str:
        """A directory every host sees (outside each host's own /tmp)."""
        path = os.path.join(self.workdir, name)
        os.makedirs(path, exist_ok=True)
        return path

    def app(self, name: str, cores: int, executor_cores: int, conf=()):
        """A driver program serving scenarios (`_standalone.App`); close it when done."""
        return self.spark.app(name, {"cores": cores, "executor_cores": executor_cores,
                                     "conf": [list(kv) for kv in conf]})

    def restart_worker(self, host) -> None:
        """A new Worker on `host` after a test killed its Worker JVM."""
        self.spark.restart_worker(host.box, CORES)

    def leftovers(self):
        """Rank processes, zygotes and /dev/shm entries on any worker host."""
        left = []
        for host in self.workers:
            for box in host.boxes:
                left += [f"{box.name}:/dev/shm/{n}" for n in box.shm()]
            for pid in host.pids():
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                if "collectives.worker" in cmd or "collectives.zygote" in cmd:
                    left.append(f"{host.name}: pid {pid} {cmd[:120]}")
        return left


@pytest.fixture(scope="session")
def cluster():
    why = unavailable()
    if why:
        pytest.skip(f"emulated cluster unavailable: {why}")
    workdir = tempfile.mkdtemp(prefix="hvs-cluster-", dir="/var/tmp")
    logs = os.path.join(workdir, "logs")
    os.makedirs(logs)
    started = time.monotonic()
    netns = Netns(workdir)
    try:
        head = netns.add_host("head")
        spark = Standalone(netns, head, logs)
        spark.add_workers([netns.add_host(name).box for name in WORKERS], CORES)
        print(f"\nemulated cluster up in {time.monotonic() - started:.1f} s "
              f"({len(WORKERS)} Workers, logs in {logs})", file=sys.stderr)
        yield Cluster(netns, spark, workdir)
    finally:
        left = netns.close()
        shutil.rmtree(workdir, ignore_errors=True)
        assert not left, f"teardown left {left}"
