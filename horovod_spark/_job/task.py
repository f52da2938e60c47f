"""The barrier task body: one task runs one rank in a child process.

Terms.  The *task* is the PySpark worker running `run_task` for one partition;
its partition id is the *rank*.  The *child* is the rank process
(`python -m collectives.launch.worker` under a keeper, `collectives.launch.keeper`) the
task starts: crash isolation, a clean CUDA context, its own process group, and nothing
it starts outlives it.  The task sends the job's secret and the pickled function on the
child's own channel (`collectives.launch.channel`) and takes the child's result from
there only: a result is the rank's when it came on that channel and the child exited 0.
The *task store* (`_spark_store.SparkStore`) is the store server the task hosts on its
executor's address for its rank; the keys the ranks share go to the job store (the
driver's, or rank 0's task store, found in one `allGather` round).

Placement comes from `BarrierTaskContext.getTaskInfos()`: a rank's host is the
host part of its task's address; local rank is its order among the ranks on
that host.  GPUs: the tasks of a host publish their Spark-assigned GPU
(`TaskContext.resources()`) in the job store, and each rank process gets
`CUDA_VISIBLE_DEVICES` = the first GPU of every rank on its host, in local-rank
order (and `CUDA_DEVICE_ORDER=PCI_BUS_ID`, the order discovery scripts number
GPUs in).  So CUDA ordinal `hvd.local_rank()` is the rank's own GPU, and
Horovod's `torch.cuda.set_device(hvd.local_rank())` and
`tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")` work as they
are; no GPU of another job is visible.  Where the addresses repeat (executors
in containers that each number their own GPUs from 0) a rank sees only its own.

The child dies with the task: its keeper's PR_SET_PDEATHSIG (Spark SIGKILLs the
worker of a killed task), the driver's abort frame on the log channel, and a stop of
the keeper (`procs.stop_kept`) in `finally`.  A failure leaves the task as a
`RankFailed` whose text carries the failure record (`markers.marked_failure`),
and the same record goes to the driver on the log channel first.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import subprocess
import sys
import sysconfig
import threading
import time
import traceback
from typing import Iterator, Optional, Tuple

from collectives.launch.channel import LauncherEnd
from collectives.launch.frameworks import VARIABLES as FRAMEWORK_VARIABLES
from collectives.launch.frameworks import reserve_tf_port, tf_installed, tf_port_key
from collectives.launch.procs import kept, pump, stop_kept
from collectives.launch.record import Failure, RankResult, signal_name

from .cluster import TaskRow
from .logchannel import CALLBACK_MARK, LogClient, split_lines
from .markers import marked_failure
from ..settings import WARM_START

__all__ = ["TaskSpec", "run_task"]

TAIL = 20
#: Lines a task keeps to hand back with its result when the live channel cannot carry them.
RETURNED = 1000


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """What every task of one job attempt needs; pickled into the barrier stage."""
    job: str                      # key prefix of this job and attempt
    secret: bytes                 # the per-job secret (32 bytes), which the ranks hold
    task_key: bytes               # the tasks' and the driver's key (log channel, job store):
                                  # no rank process ever holds it
    payload: bytes                # cloudpickle of (fn, args, kwargs)
    log_address: Optional[str]    # host:port of the driver's log server
    env: Tuple[Tuple[str, str], ...] = ()
    show_output: bool = True      # forward every line, not only log_to_driver's
    rank0_only: bool = False      # only rank 0 returns its value (HorovodRunner)
    result_limit: int = 0         # spark.driver.maxResultSize in bytes; 0: none
    executable: Optional[str] = None
    warm: bool = True             # fork the rank from the executor's zygote when it has one
    job_store: Optional[str] = None  # host:port of the driver's job store (None: allGather)
    torch_layout: str = "hosts"   # torchrun's variables: a node per host, or per task
    zygote_token: bytes = b""     # the session's token its zygotes prove (warm.session_token);
                                  # none: no warm start
    driver_only: Tuple[Tuple[str, str], ...] = ()  # rank-side variables set only on the driver


#: Seconds a GPU task waits for the other tasks of its host to publish their GPUs.
GPU_EXCHANGE_TIMEOUT = 120.0


def task_hosts(ctx) -> list:
    """The host part of every task's address, in rank order."""
    return [info.address.rsplit(":", 1)[0].strip("[]") for info in ctx.getTaskInfos()]


def placement(hosts: list, rank: int, spec: TaskSpec, store_addr: str):
    """This task's RankEnv: local rank = order among the ranks on the same host."""
    from collectives.launch.rankenv import rank_env

    return rank_env(rank, hosts, store_addr, spec.secret, spec.job, bind_addr=hosts[rank])


def _python_path() -> str:
    """This worker's sys.path minus the interpreter's own dirs, so the child imports alike."""
    own = {os.path.realpath(p) for p in sysconfig.get_paths().values()}
    keep = [p for p in sys.path if p and os.path.exists(p) and os.path.realpath(p) not in own]
    return os.pathsep.join(dict.fromkeys(keep))


def child_env(spec: TaskSpec, renv, gpus: Optional[Tuple[list, int]]) -> dict:
    """The rank process's environment; gpus: (the GPUs it sees, the ordinal of its own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON_WORKER_FACTORY")
           and k not in FRAMEWORK_VARIABLES}  # (a reused Python worker keeps another job's
    env.update(dict(spec.env))                # TF_CONFIG: spark-tensorflow-distributor sets it)
    env.update(renv.to_environ())
    env["PYTHONPATH"] = _python_path()
    env["PYTHONUNBUFFERED"] = "1"
    env["HVS_LOG_CALLBACK"] = "1"
    if spec.rank0_only:  # the others' values are thrown away: they are never pickled
        env["HVS_RETURN_RANKS"] = "0"
    if gpus is not None:
        visible, ordinal = gpus
        env["CUDA_VISIBLE_DEVICES"] = ",".join(visible)
        env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        env["HVS_GPU_ORDINAL"] = str(ordinal)  # hvd.init() makes it the current device
    return env


def host_gpus(store, job: str, rank: int, hosts: list, mine: list,
              timeout: float) -> Tuple[list, int]:
    """(the first GPU of every rank on this rank's host in local-rank order, this rank's
    ordinal among them), exchanged through the job store (see the module docstring); only
    this task's GPUs, ordinal 0, where the names repeat."""
    key = f"{job}/gpus/"
    store.set(key + str(rank), ",".join(mine).encode())
    local = [q for q, h in enumerate(hosts) if h == hosts[rank]]
    firsts = [mine[0] if r == rank else store.get(key + str(r), timeout).decode().split(",")[0]
              for r in local]
    if len(set(firsts)) != len(firsts):
        return list(mine), 0
    return firsts, local.index(rank)


class RankProcess:
    """The child of one task, from start to its result or its failure record."""

    def __init__(self, spec: TaskSpec, ctx) -> None:
        from .spark_store import SparkStore

        self.spec, self.ctx, self.rank = spec, ctx, ctx.partitionId()
        self.hosts = hosts = task_hosts(ctx)
        self.size = len(hosts)
        self.aborted = False
        self.tail: collections.deque = collections.deque(maxlen=TAIL)
        self.unsent: collections.deque = collections.deque(maxlen=RETURNED)
        self.server = SparkStore(hosts[self.rank], spec.secret, spec.job, self.rank, self.size,
                                 ctx.allGather, job_store=spec.job_store,
                                 job_store_key=spec.task_key)
        try:
            self.renv = placement(hosts, self.rank, spec, self.server.address)
        except BaseException:
            self.server.close()
            raise
        self.log = LogClient(spec.log_address, spec.task_key, spec.job, self.rank,
                             on_abort=self.abort)
        self.channel = LauncherEnd(spec.secret, spec.payload)
        self.child = None  # subprocess.Popen of the keeper, or warm.WarmChild from the zygote
        self.env: dict = {}
        self.warm = spec.warm
        self._pumps: list = []
        self._tf_port = None  # the socket that holds the rank's tf.distribute port

    def start(self) -> None:
        from . import warm

        gpus = self.ctx.resources().get("gpu")
        executable = self.spec.executable or sys.executable
        if tf_installed():  # the rank's tf.distribute port (collectives.launch.frameworks),
            # shared before anything starts the store's round, which may carry it
            self._tf_port, value = reserve_tf_port(self.hosts[self.rank])
            self.server.share(tf_port_key(self.spec.job, self.rank), value)
        visible = None
        if gpus is not None and self.spec.torch_layout == "tasks":  # a node each: its own GPUs
            visible = list(gpus.addresses), 0
        elif gpus is not None:
            visible = host_gpus(self.server, self.spec.job, self.rank, self.hosts,
                                list(gpus.addresses), GPU_EXCHANGE_TIMEOUT)
        self.env = env = child_env(self.spec, self.renv, visible)
        env.update(self.torchrun_environ())
        self._say_driver_only(env)
        self.warm = (self.warm and gpus is None and bool(self.spec.zygote_token)
                     and WARM_START.read(env))  # the task's edge
        if self.warm:
            env["HVS_WARM_REPORT"] = ",".join(warm.REPORT)
            self.child = self._forked(executable, env)
        if self.child is None:
            self.child = subprocess.Popen(
                kept([executable, "-m", "collectives.launch.worker"]),
                env={**env, **self.channel.environ()}, pass_fds=(self.channel.rank_fd,),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True)
        self.channel.started()
        for pipe, stream in ((self.child.stdout, "stdout"), (self.child.stderr, "stderr")):
            t = threading.Thread(target=pump, daemon=True,
                                 args=(pipe, functools.partial(self._line, stream), split_lines))
            t.start()
            self._pumps.append(t)

    def _say_driver_only(self, env: dict) -> None:
        """Rank 0's task names the rank-side variables the driver has and this rank has not
        (or has with another value): set on the driver alone, they do nothing."""
        missed = [(k, v) for k, v in self.spec.driver_only if env.get(k) != v]
        if self.rank != 0 or not missed:
            return
        here = ", ".join(f"{k}={env[k]!r}" if k in env else f"no {k}" for k, _ in missed)
        self.log.line("cb", f"horovod_spark: warning: "
                            f"{', '.join(f'{k}={v!r}' for k, v in missed)} from the driver's "
                            f"environment does nothing: the ranks read it, and their environment "
                            f"is the executors' (rank 0 has {here}); pass it in the job's env "
                            f"(run(env=...), HorovodRunner.run's env) or spark.executorEnv")

    def _forked(self, executable: str, env: dict):
        """The rank forked from the executor's zygote, or None; where it was not, the fresh
        start gets a fresh channel (a zygote that went silent may hold the rank end)."""
        from . import warm

        try:
            child = warm.spawn(executable, env, self.channel.rank_fd, self.spec.zygote_token)
        except warm.ZygoteUntrusted as exc:
            child = None
            note = (f"horovod_spark: warning: rank {self.rank}: {exc}; nothing was handed to "
                    f"it, the rank starts fresh")
            self.tail.append(f"[{self.rank}]<stderr>:{note}")  # in its failure, if it fails
            self.log.line("cb", note)
        if child is None:
            self.channel.close()
            self.channel = LauncherEnd(self.spec.secret, self.spec.payload)
        return child

    def torchrun_environ(self) -> dict:
        """torchrun's variables (see `collectives.launch.torchrun`): MASTER_ADDR is rank 0's
        task address, MASTER_PORT the port rank 0's task reserved there."""
        from collectives.launch.torchrun import torchrun_environ

        from collectives.launch.frameworks import jax_environ

        run_id, _, attempt = self.spec.job.rpartition("/a")
        port = self.server.master_port()
        return {**torchrun_environ(self.renv, self.hosts[0], port, run_id,
                                   int(attempt) if attempt.isdigit() else 0,
                                   self.spec.torch_layout),
                **jax_environ(self.hosts[0], port)}

    def _line(self, stream: str, text: str) -> None:
        kind = stream
        if text.startswith(CALLBACK_MARK):
            text, kind = text[len(CALLBACK_MARK):], "cb"
        self.tail.append(f"[{self.rank}]<{stream}>:{text}")
        if kind == "cb" or self.spec.show_output:
            self.log.line(kind, text)
            if self.log.broken:  # no live channel: the line goes back with the result
                self.unsent.append((kind, text))
        if self.log.broken:  # keep the line in the executor's log at least
            print(f"[{self.rank}]<{stream}>:{text}", file=sys.stderr, flush=True)

    def abort(self) -> None:
        """The driver says the job failed elsewhere: kill the child now."""
        self.aborted = True
        self.kill()

    def kill(self) -> None:
        if self.child is not None:
            stop_kept([self.child])

    def wait(self) -> int:
        rc = self.child.wait()
        for t in self._pumps:
            t.join(timeout=2.0)
        return rc

    def outcome(self, rc: int) -> Optional[bytes]:
        """The encoded `RankResult` of a rank that returned and exited 0, or raise RankFailed
        (a rank that died by a signal failed, whatever it sent before)."""
        self.channel.finish()
        blob = self.channel.result
        result = RankResult.decode(blob) if blob is not None else None
        if result is not None and result.ok and rc != 0:
            result = None
        if result is not None and result.ok:
            from .checks import check_result_size

            if self.spec.rank0_only and self.rank != 0:
                return None
            try:
                check_result_size(len(blob), self.spec.result_limit, self.rank)
            except ValueError as exc:
                self._fail(self._failure(rc, Failure(self.rank, "ResultTooLarge", str(exc))))
            return blob
        self._fail(self._failure(rc, result.failure if result is not None else None))

    def _failure(self, rc: int, own: Optional[Failure]) -> Failure:
        """This rank's failure: its own account if it gave one, else how its process ended."""
        if own is None and rc < 0:
            own = Failure(self.rank, "ProcessDied",
                          f"the rank process was killed by signal {signal_name(rc)}")
        elif own is None:
            own = Failure(self.rank, "ProcessExited", f"the rank process exited with status {rc} "
                                                      f"without returning a result")
        return dataclasses.replace(own, rank=self.rank, size=self.size, host=self.renv.host,
                                   exitcode=rc, tail=tuple(self.tail), aborted=self.aborted,
                                   time=time.time())

    def _fail(self, failure: Failure) -> None:
        self.log.failure(failure.to_dict())
        raise marked_failure(failure)

    def cleanup(self) -> None:
        from collectives.backends.shm_names import remove_segments_of

        self.kill()
        if self.child is not None:
            try:
                self.child.wait(timeout=5.0)
                remove_segments_of(self.child.pid)  # a rank killed while sharing its segment
            except subprocess.TimeoutExpired:
                pass
        try:
            self._prepare_warm_start()
        finally:
            if self._tf_port is not None:
                self._tf_port.close()
            self.channel.close()
            self.server.close()
            self.log.close()

    def _prepare_warm_start(self) -> None:
        """After a rank that succeeded: the zygote for the next job (see _warm)."""
        report = self.channel.modules
        if not self.warm or self.child is None or self.child.returncode != 0 or report is None:
            return
        from . import warm

        imported = report.decode("ascii", "replace").split(",")
        warm.learn(self.spec.executable or sys.executable, self.env, imported,
                   self.spec.zygote_token)


def run_task(spec: TaskSpec, _partition: Iterator
             ) -> Iterator[Tuple[int, Optional[bytes], Optional[str]]]:
    """The mapPartitions body of the barrier stage: yields (rank, encoded RankResult, or b""
    when it went to the driver's job store, or None for a value nobody wants; the output
    lines the live channel did not carry, as JSON [[stream, text], ...], or None)."""
    from pyspark import BarrierTaskContext

    proc = RankProcess(spec, BarrierTaskContext.get())
    try:
        try:
            proc.start()
        except OSError as exc:  # no such executable, no memory to fork, ...
            proc._fail(proc._failure(-1, Failure(proc.rank, "RankStartFailed",
                                                 f"cannot start the rank process: {exc}",
                                                 traceback=traceback.format_exc())))
        result = proc.outcome(proc.wait())
        if result is not None and proc.server.deliver(delivered_key(spec.job, proc.rank), result):
            result = b""  # delivered: the row only says so
    finally:
        proc.cleanup()
    yield TaskRow(proc.rank, result, json.dumps(list(proc.unsent)) if proc.unsent else None)


def delivered_key(job: str, rank: int) -> str:
    """Where a rank's encoded result waits in the driver's job store."""
    return f"{job}/delivered/{rank}"

