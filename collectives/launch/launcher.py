"""Local launcher: N rank processes on this machine, no Spark.

`run_local(fn, np)` runs a cloudpickled function as every rank and returns
every rank's value; `python -m collectives.launch -n N script.py args` runs a
script as every rank.  The launcher hosts the authenticated rendezvous store,
streams each rank's output prefixed Horovod's way (`[1]<stdout>:...`), and on
the first failure kills every rank's process group and raises `RankFailed`
naming the root-cause rank.  Ranks die with the launcher (PR_SET_PDEATHSIG),
so nothing is ever left behind.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import uuid
from typing import Callable, Optional, Sequence

import cloudpickle

from ..rendezvous import auth
from .channel import LauncherEnd
from .procs import RankFailed, RankGroup, finish_grace, kept
from .rankenv import RankEnv, rank_envs
from .frameworks import VARIABLES as FRAMEWORK_VARIABLES
from .frameworks import jax_environ, reserve_tf_port, tf_installed, tf_port_key
from .torchrun import reserve_port, torchrun_environ
from ..rendezvous.store import TCPStore

__all__ = ["run_local", "RankFailed", "RankEnv", "main"]




def _driver_path(existing: str) -> str:
    """The ranks import what the launching process imports (its sys.path first)."""
    parts = [p or os.getcwd() for p in sys.path if p == "" or os.path.isdir(p)]
    parts += [p for p in existing.split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys(parts))


def start_ranks(cmd: Sequence[str], np_: int, env: Optional[dict] = None, hosts=None,
                stdout=None, stderr=None, secret: Optional[bytes] = None, prefix_output: bool = True,
                payload: Optional[bytes] = None,
                prepare: Optional[Callable[[TCPStore, str], None]] = None, attempt: int = 0):
    """Start np_ kept processes running cmd with the rank environment (torchrun's too: see
    `torchrun`), each sent the secret (and `payload`) on its own channel; `prepare(store,
    job)` runs before they start; `attempt` counts a job's restarts.  Returns (group, store)."""
    if not isinstance(np_, int) or np_ < 1:
        raise ValueError(f"np must be a positive number of ranks, got {np_!r}")
    secret = secret or auth.new_secret()
    server = TCPStore.serve("127.0.0.1", secret)
    job = f"job-{uuid.uuid4().hex[:12]}"
    procs, channels, master, tf_ports = [], [], None, []
    try:
        if prepare is not None:
            prepare(server, job)
        master = reserve_port("127.0.0.1")
        tf = tf_installed()
        for renv in rank_envs(np_, server.address, secret, job, hosts):
            if tf:  # the rank's tf.distribute server's port (frameworks.py)
                held, value = reserve_tf_port("127.0.0.1")
                tf_ports.append(held)
                server.set(tf_port_key(job, renv.rank), value)
            channel = LauncherEnd(secret, payload)
            channels.append(channel)
            child_env = {k: v for k, v in os.environ.items() if k not in FRAMEWORK_VARIABLES}
            child_env["PYTHONPATH"] = _driver_path(child_env.get("PYTHONPATH", ""))
            child_env.update(env or {})
            child_env.update(renv.to_environ())
            child_env.update(torchrun_environ(renv, "127.0.0.1", master.getsockname()[1], job,
                                              attempt))
            child_env.update(jax_environ("127.0.0.1", master.getsockname()[1]))
            child_env.update(channel.environ())
            procs.append(subprocess.Popen(kept(cmd), env=child_env, pass_fds=(channel.rank_fd,),
                                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, start_new_session=True))
            channel.started()
    except BaseException:
        for p in procs:
            p.kill()
            p.wait()
        for channel in channels:
            channel.close()
        for held in [master, *tf_ports]:
            if held is not None:
                held.close()
        server.close()
        raise
    group = RankGroup(procs, server, job, stdout or sys.stdout, stderr or sys.stderr, prefix_output,
                      channels, held=[master, *tf_ports])
    return group, server


def run_local(fn, np: int, args: Sequence = (), kwargs: Optional[dict] = None,
              env: Optional[dict] = None, stdout=None, stderr=None, timeout: Optional[float] = None,
              secret: Optional[bytes] = None, hosts: Optional[Sequence[str]] = None,
              prefix_output: bool = True) -> list:
    """Run fn(*args, **kwargs) as np local ranks; returns every rank's value in rank order.

    Once a rank has returned, the others have HOROVOD_SPARK_FINISH_GRACE_SECONDS (from
    `env`, then this process's environment) to return too.

    Raises:
        RankFailed: naming the first failing rank, its exit status and traceback.
    """
    grace = finish_grace(env)
    if not callable(fn):
        raise TypeError(f"run_local needs a callable, got {type(fn).__name__}")
    if isinstance(args, (str, bytes)) or not isinstance(args, (tuple, list)):
        raise TypeError(f"run_local: args must be a tuple or list of positional arguments, got "
                        f"{type(args).__name__} {args!r:.60}; for one argument write args=(x,)")
    try:
        blob = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
    except Exception as exc:
        raise TypeError(f"the function or its arguments cannot be pickled: {exc}") from exc
    group, _ = start_ranks([sys.executable, "-m", "collectives.launch.worker"], np, env, hosts,
                           stdout, stderr, secret, prefix_output, payload=blob)
    with group:
        return group.wait_results(timeout, grace)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m collectives.launch",
                                description="Run a script as N local ranks.")
    p.add_argument("-n", "--np", type=int, required=True, help="number of ranks")
    p.add_argument("--hosts", help="comma-separated host identity per rank (fakes placement)")
    p.add_argument("--tcp", action="store_true", help="force the TCP path between all ranks")
    p.add_argument("--timeout", type=float, default=None, help="seconds before the job is killed")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    ns = p.parse_args(argv)
    env = {"HOROVOD_SPARK_FORCE_TCP": "1"} if ns.tcp else {}
    hosts = ns.hosts.split(",") if ns.hosts else None
    group, _ = start_ranks([sys.executable, ns.script, *ns.args], ns.np, env, hosts)
    with group:
        try:
            group.wait_exit(ns.timeout, finish_grace())
        except RankFailed as exc:
            print(f"collectives.launch: {exc}", file=sys.stderr)
            return exc.exitcode if exc.exitcode and exc.exitcode > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
