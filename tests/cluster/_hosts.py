"""An emulated cluster on one machine: hosts as Linux network namespaces.

Terms.  A *host* is a network namespace with one address from SUBNET on its
`eth0`, one end of a veth pair whose other end sits in a *bridge* (br0) that
lives in a namespace of its own, so nothing of the cluster touches the
machine's own namespace: no default route, no NAT, traffic only between the
cluster's addresses and loopback.  A *box* is a mount and UTS namespace on a
host, held open by a *holder* process (`sleep`): its own hostname, its own
tmpfs `/dev/shm` and `/tmp` (the directories of the machine's /tmp that the cluster's
processes need, a venv or the work tree made there, bound through: `kept_under_tmp`), and an
`/etc/hosts` naming every host.  A host
has one box, or several that share its address but not their `/dev/shm`
(containers with host networking).  Every process of the cluster enters its
box through `nsenter` on the holder's pid; every one is found again at
teardown, by namespace, and ended by pid.  Code and stores reach every box
through directories outside `/tmp` (the work tree, and the cluster's shared
directory), as a cluster reaches them over NFS.
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

__all__ = ["SUBNET", "Box", "Host", "Netns", "unavailable"]

#: The one private /24 the emulated cluster uses; every address it assigns is in it.
SUBNET = "10.213.7"
_PR_SET_PDEATHSIG = 1


def unavailable() -> Optional[str]:
    """Why this machine cannot build the cluster, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nsenter", "unshare", "java"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    probe = f"hvsc-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _die_with_parent() -> None:
    """Popen's preexec_fn: a cluster process dies with the test process, even on SIGKILL."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def kept_under_tmp() -> List[str]:
    """The top directories under /tmp that the cluster's processes need and a box's private
    /tmp would hide: the interpreter's prefixes (a venv made under /tmp), the work tree and
    the directory tests run from."""
    here = os.path.dirname(os.path.abspath(__file__))
    found = []
    for path in (sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(sys.executable),
                 os.path.realpath(sys.executable), here, os.getcwd()):
        for p in {os.path.abspath(path), os.path.realpath(path)}:
            parts = p.split(os.sep)
            if len(parts) > 2 and parts[1] == "tmp":
                top = os.sep.join(parts[:3])
                if os.path.isdir(top) and top not in found:
                    found.append(top)
    return found


class Box:
    """A mount + UTS namespace on a host: one hostname, one /dev/shm, one /tmp."""

    def __init__(self, host: "Host", name: str, etc_hosts: str) -> None:
        self.host, self.name = host, name
        # what the box must still see under its own /tmp: the interpreter, a venv, the work
        # tree, when they live in the machine's /tmp (bound aside, then back over the tmpfs)
        keep = os.path.join(os.path.dirname(etc_hosts), "keep", name)
        aside, back = [], []
        for i, path in enumerate(kept_under_tmp()):
            os.makedirs(f"{keep}/{i}", exist_ok=True)
            aside.append(f"mount --bind {path} {keep}/{i}")
            back.append(f"mkdir -p {path} && mount --bind {keep}/{i} {path}")
        script = " && ".join([f"hostname {name}", "mount -t tmpfs -o size=2g tmpfs /dev/shm",
                              *aside, "mount -t tmpfs -o size=2g tmpfs /tmp", *back,
                              f"mount --bind {etc_hosts} /etc/hosts", "exec sleep 86400"])
        self.holder = subprocess.Popen(
            ["ip", "netns", "exec", host.netns, "unshare", "--uts", "--mount", "--propagation",
             "private", "sh", "-c", script], preexec_fn=_die_with_parent,
            stdin=subprocess.DEVNULL)
        self._wait_ready()

    def _wait_ready(self) -> None:
        for _ in range(200):  # the holder mounts, then sleeps: at most ~10 s
            if self.holder.poll() is not None:
                raise RuntimeError(f"box {self.name}: its holder exited {self.holder.returncode}")
            if self.run(["hostname"], check=False).stdout.strip() == self.name:
                return
            time.sleep(0.05)
        raise RuntimeError(f"box {self.name} never came up")

    def argv(self, cmd: Sequence[str]) -> List[str]:
        # --wd: entering a mount namespace resets the working directory to its root
        return ["nsenter", "-t", str(self.holder.pid), "-n", "-m", "-u", f"--wd={os.getcwd()}",
                "--", *cmd]

    def spawn(self, cmd: Sequence[str], env: Dict[str, str], log: str,
              stdin=subprocess.DEVNULL) -> subprocess.Popen:
        """Start cmd in this box, its output to log; it dies with the test process."""
        with open(log, "ab") as out:
            return subprocess.Popen(self.argv(cmd), env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=stdin, preexec_fn=_die_with_parent)

    def run(self, cmd: Sequence[str], env: Optional[Dict[str, str]] = None, timeout: float = 30,
            check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(self.argv(cmd), env=env, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
        if check and done.returncode != 0:
            raise RuntimeError(f"{self.name}: {' '.join(cmd)} exited {done.returncode}: "
                               f"{done.stderr[-2000:]}")
        return done

    def shm(self) -> List[str]:
        """What this box's /dev/shm holds."""
        return sorted(self.run(["ls", "-A", "/dev/shm"]).stdout.split())


class Host:
    """A network namespace with one address, and its boxes."""

    def __init__(self, netns: str, name: str, address: str) -> None:
        self.netns, self.name, self.address = netns, name, address
        self.boxes: List[Box] = []

    @property
    def box(self) -> Box:
        return self.boxes[0]

    def pids(self) -> List[int]:
        """Every process in this host's network namespace."""
        done = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True, text=True)
        return [int(p) for p in done.stdout.split()]

    def listeners(self, marker: bytes) -> List[tuple]:
        """(address, port) of the TCP listeners, not on loopback, held by this host's
        processes whose command line holds `marker`."""
        found, table = set(), None
        for pid in self.pids():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker not in f.read():
                        continue
                if table is None:  # one view of the namespace's sockets serves every pid
                    table = _tcp_listeners(pid)
                inodes = set()
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    try:
                        inodes.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
                    except OSError:  # closed meanwhile
                        pass
            except OSError:  # it exited meanwhile
                continue
            found |= {table[i] for i in table if f"socket:[{i}]" in inodes}
        return sorted(a for a in found if not a[0].startswith("127."))


def _tcp_listeners(pid: int) -> Dict[str, tuple]:
    """inode -> (address, port) of the listening IPv4 sockets in pid's network namespace."""
    out = {}
    with open(f"/proc/{pid}/net/tcp") as f:
        for row in f.readlines()[1:]:
            fields = row.split()
            if fields[3] != "0A":  # LISTEN
                continue
            addr, port = fields[1].split(":")
            out[fields[9]] = (socket.inet_ntoa(struct.pack("<I", int(addr, 16))), int(port, 16))
    return out


class Netns:
    """The hosts, the bridge between them, and teardown.  See the module docstring."""

    def __init__(self, workdir: str) -> None:
        self.tag = f"hvsc{os.getpid()}"
        self.workdir = workdir
        self.bridge = f"{self.tag}-br"
        self.hosts: List[Host] = []
        self._etc_hosts = os.path.join(workdir, "etc-hosts")
        self._names: List[tuple] = []
        _ip("netns", "add", self.bridge)
        _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge, "link", "set", "br0", "up")
        _ip("-n", self.bridge, "link", "set", "lo", "up")

    def add_host(self, name: str, boxes: int = 1) -> Host:
        """A host at the next address of SUBNET, with `boxes` boxes (hostnames name, name-b, ...)."""
        index = len(self.hosts) + 1
        host = Host(f"{self.tag}-{name}", name, f"{SUBNET}.{10 + index}")
        _ip("netns", "add", host.netns)
        self.hosts.append(host)
        _ip("-n", self.bridge, "link", "add", f"v{index}", "type", "veth", "peer", "name", "eth0",
            "netns", host.netns)
        _ip("-n", self.bridge, "link", "set", f"v{index}", "master", "br0", "up")
        _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _ip("-n", host.netns, "link", "set", "eth0", "up")
        _ip("-n", host.netns, "link", "set", "lo", "up")
        names = [name] + [f"{name}-{chr(ord('b') + i)}" for i in range(boxes - 1)]
        self._names += [(host.address, n) for n in names]
        self._write_etc_hosts()
        host.boxes = [Box(host, n, self._etc_hosts) for n in names]
        return host

    def _write_etc_hosts(self) -> None:
        lines = ["127.0.0.1 localhost"] + [f"{a} {n}" for a, n in self._names]
        with open(self._etc_hosts, "w") as f:
            f.write("\n".join(lines) + "\n")

    def shape(self, rate: str, delay: str) -> str:
        """Every host link at `rate` and `delay` each way, on both ends of each veth: netem
        where the kernel has it, else tbf (rate only: no delay).  Returns what was applied."""
        applied = f"netem rate {rate} delay {delay}"
        for i, host in enumerate(self.hosts, 1):
            for ns, dev in ((host.netns, "eth0"), (self.bridge, f"v{i}")):
                tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root"]
                if applied.startswith("netem") and subprocess.run(
                        tc + ["netem", "rate", rate, "delay", delay, "limit", "100000"],
                        capture_output=True).returncode == 0:
                    continue
                applied = f"tbf rate {rate} (this kernel has no netem: no delay)"
                subprocess.run(tc + ["tbf", "rate", rate, "burst", "256kb", "latency", "50ms"],
                               check=True, capture_output=True)
        return applied

    def link(self, host: Host, up: bool) -> None:
        """Cut or restore a host's link (on the bridge side, as a switch port)."""
        _ip("-n", self.bridge, "link", "set", f"v{self.hosts.index(host) + 1}",
            "up" if up else "down")

    def partition(self, a: Host, b: Host, cut: bool) -> None:
        """Drop (or restore) every packet between hosts a and b, each still reaching the
        others: a blackhole route to the other's address in each host."""
        for host, other in ((a, b), (b, a)):
            _ip("-n", host.netns, "route", "add" if cut else "del", "blackhole",
                f"{other.address}/32")

    def close(self) -> List[str]:
        """End every process of the cluster by pid, delete every namespace: what was left."""
        left: List[str] = []
        for _ in range(3):  # a process may fork while we kill: a few passes, bounded
            pids = [p for h in self.hosts for p in h.pids()]
            for host in self.hosts:
                pids += [b.holder.pid for b in host.boxes if b.holder.poll() is None]
            if not pids:
                break
            for pid in set(pids):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for host in self.hosts:
                for b in host.boxes:
                    try:
                        b.holder.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        left.append(f"holder of {b.name} (pid {b.holder.pid})")
            time.sleep(0.2)
        for host in self.hosts:
            if host.pids():
                left.append(f"processes {host.pids()} in {host.name}")
        for ns in [h.netns for h in self.hosts] + [self.bridge]:
            if subprocess.run(["ip", "netns", "del", ns], capture_output=True).returncode != 0:
                left.append(f"netns {ns}")
        self.hosts = []
        return left


def result_lines(output: str) -> List[dict]:
    """The JSON objects a driver program printed after 'RESULT ', in order."""
    return [json.loads(line[len("RESULT "):]) for line in output.splitlines()
            if line.startswith("RESULT ")]


def python() -> str:
    return sys.executable
