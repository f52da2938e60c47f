"""The Spark Store: the rendezvous store of a job on barrier tasks.

Terms.  Every task hosts a *task store* (a `StoreServer` bound to its
executor's address) that its rank process connects to.  *Shared* keys (every key
under `{job}/`: the mesh publications, the native backend's shared-memory name, the
NCCL unique id) live in one *job store*, which every task store forwards them to;
what is not shared stays in the task store.  The function and the result do not
travel here: they go on the rank's own channel (`collectives.launch.channel`).

The job store is, by default, a `StoreServer` the driver runs for the job
attempt on its own address (spark.driver.host, which every executor reaches
already), under the *task key*, which only the tasks and the driver hold (never a
rank): its address travels in the task spec, so no task has to find it.  A task
delivers its rank's result there (`{job}/delivered/...`), a key no rank can reach:
the task store never forwards it.  Where the driver cannot serve one (it cannot listen, or
HOROVOD_SPARK_RENDEZVOUS=spark), the job store is the task store of rank 0,
and the *round*, one `BarrierTaskContext.allGather`, tells every task its
address; the round runs once per job attempt, when the task's rank first
touches a shared key or its task asks torch's MASTER_PORT.  What a task *shares* before
the round (`share`: its rank's tf.distribute port) travels in the round's messages then,
and every task store holds every task's value itself: rank 0's task may have ended (its
rank returned at once) before another task's rank asks its store, and a rank that reads
such a key waits for the round, not for rank 0.  Each allGather costs about a second here (PySpark
polls its barrier RPC once a second), which is why the driver's store is the
default.

So a rank's store traffic is: shared keys forwarded to the job store, over
connections that run the HMAC handshake (with the task key to the driver's, with
the job secret to rank 0's) like every other.  Forwarding, not replaying rounds, is why any
pattern of store use works (one rank sets, the others wait; atomic counters).

A round that never completes (a rank that never calls init()) fails the
waiting rank's store request after `round_timeout`, with a message naming it;
a driver store that cannot be reached fails it with the address and the switch.
"""
from __future__ import annotations

import json
import threading
from typing import Callable, List, Optional

from collectives.errors import CollectiveTimeout, PeerLostError, describe
from collectives.rendezvous.store import StoreServer, TCPStore

__all__ = ["SparkStore"]


class SparkStore(StoreServer):
    """The task store of one rank; forwards shared keys to rank 0's (see the module docstring).

    Args:
        bind: this executor's address (the task's address from getTaskInfos()).
        secret: the job secret.
        job: the key prefix of this job and attempt.
        rank: this task's rank; rank 0 serves the shared keys itself.
        all_gather: `BarrierTaskContext.allGather` (str -> list of str in rank order).
        size: the number of tasks.
        job_store: host:port of the driver's job store; None: rank 0's, found by a round.
        job_store_key: the key of the driver's job store (the task key).
    """

    def __init__(self, bind: str, secret: bytes, job: str, rank: int, size: int,
                 all_gather: Callable[[str], List[str]], round_timeout: float = 300.0,
                 job_store: Optional[str] = None, connect_timeout: float = 60.0,
                 job_store_key: Optional[bytes] = None) -> None:
        super().__init__(bind, 0, secret)
        self._upstream_key = job_store_key if job_store is not None and job_store_key else secret
        self.job, self.rank, self.size = job.rstrip("/"), rank, size
        self._all_gather, self._round_timeout = all_gather, round_timeout
        self._round_lock = threading.Lock()
        self._round_started = False
        self._round_done = threading.Event()
        self._round_error: Optional[BaseException] = None
        self.on_driver, self._connect_timeout = job_store is not None, connect_timeout
        self.job_store: Optional[str] = job_store or (self.address if rank == 0 else None)
        self._tls = threading.local()
        self._clients: list = []
        self._reserved = None  # rank 0's: the socket that holds torch's MASTER_PORT
        self._master_port: Optional[int] = None  # as the round tells it
        self._carried: dict = {}  # what this task shares in the round (see `share`)
        self.rounds = 0

    def is_shared(self, key: str) -> bool:
        head = self.job + "/"
        return (key.startswith(head) and not key.startswith(head + "delivered/")
                and not self._in_round(key))

    def _in_round(self, key: str) -> bool:
        """Whether `key` is one the round carries (every task store holds it)."""
        return not self.on_driver and key.startswith(self.job + "/" + self.CARRIED)

    #: The keys `share` takes, under the job's prefix.
    CARRIED = "tf/"

    def share(self, key: str, value: bytes) -> None:
        """Give every rank `key` (under `{job}/tf/`): set in the driver's job store, or carried
        in this task's message of the round, before the round starts (see the module
        docstring)."""
        if not key.startswith(self.job + "/" + self.CARRIED):
            raise ValueError(f"{key!r} is not a key the round carries ({self.job}/{self.CARRIED}...)")
        if self.on_driver:
            self._client().set(key, value)
            return
        with self._round_lock:
            if self._round_started:
                raise RuntimeError(f"{key!r} is shared after the round of {self.job} began")
            self._carried[key] = value.decode()

    def _await_carried(self, key: str) -> None:
        if self._in_round(key):  # the round's values: every task's, once the round is done
            self._start_round()
            self._wait_round()

    # -- the round -----------------------------------------------------------
    def _start_round(self) -> None:
        with self._round_lock:
            if self._round_started:
                return
            self._round_started = True
        threading.Thread(target=self._round, name="hvs-spark-store-round", daemon=True).start()

    def _round(self) -> None:
        try:
            mine = {"job": self.job, "rank": self.rank, "store": self.address,
                    "carried": self._carried}
            if self.rank == 0:  # rank 0's task may be gone before the others ask its store
                mine["master_port"] = self._reserve()
            replies = [json.loads(r) for r in self._all_gather(json.dumps(mine))]
            self.rounds += 1
            for sender, reply in enumerate(replies):
                if reply.get("job") != self.job or reply.get("rank") != sender:
                    raise ValueError(describe(
                        f"task {sender} answered the store round for job {reply.get('job')!r}, "
                        f"not {self.job!r}", rank=self.rank, size=self.size, op="rendezvous",
                        hint="two jobs or attempts share one barrier stage"))
            for reply in replies:
                for key, value in (reply.get("carried") or {}).items():
                    if self._in_round(key):
                        StoreServer.set(self, key, value.encode())
            self.job_store = replies[0]["store"]
            self._master_port = int(replies[0]["master_port"])
        except BaseException as exc:
            self._round_error = exc
        finally:
            self._round_done.set()

    def _job_store(self) -> Optional[TCPStore]:
        """A client of the job store for this connection's thread; None where it is this one."""
        if self.on_driver:
            return self._client()
        self._start_round()
        if self.rank == 0:
            return None
        self._wait_round()
        return self._client()

    def _wait_round(self) -> None:
        if not self._round_done.wait(self._round_timeout):
            raise CollectiveTimeout(describe(
                "the store round (BarrierTaskContext.allGather) did not complete",
                rank=self.rank, size=self.size, op="rendezvous", timeout=self._round_timeout,
                hint="does every rank call collectives.init() the same number of times?"))
        if self._round_error is not None:
            raise self._round_error

    def _client(self) -> TCPStore:
        client = getattr(self._tls, "client", None)
        if client is None:
            try:
                # rank 0's store listened before the round told its address: a refusal
                # means its task has ended (its rank returned), not that it is starting
                client = TCPStore.connect(self.job_store, self._upstream_key,
                                          self._connect_timeout, listening=not self.on_driver)
            except PeerLostError as exc:
                if not self.on_driver:
                    raise
                raise PeerLostError(describe(
                    f"cannot reach the job's rendezvous store on the driver: {exc}",
                    rank=self.rank, size=self.size, op="rendezvous", address=self.job_store,
                    hint="executors must reach the driver's address (spark.driver.host) on "
                         "any port; or set HOROVOD_SPARK_RENDEZVOUS=spark on the driver to meet "
                         "through Spark's allGather (about a second more per job)")) from exc
            self._tls.client = client
            self._clients.append(client)
        return client

    def master_port(self) -> int:
        """torch's MASTER_PORT for this job attempt: rank 0's task reserves a port on its
        address (`collectives.launch.torchrun.reserve_port`, held until this store closes)
        and publishes it in the driver's job store, or in its message of the round, since
        its task store may be closed before the others ask it (a rank 0 that returned at
        once); the other tasks wait for it."""
        key = f"{self.job}/torchrun/master_port"
        if self.on_driver and self.rank == 0:
            port = self._reserve()
            self._client().set(key, str(port).encode())
            return port
        if self.on_driver:
            return int(self._client().get(key, self._round_timeout))
        self._start_round()
        if self.rank == 0:
            return self._reserve()
        self._wait_round()
        return self._master_port

    def _reserve(self) -> int:
        with self._round_lock:
            if self._reserved is None:
                from collectives.launch.torchrun import reserve_port

                self._reserved = reserve_port(self.address.rsplit(":", 1)[0].strip("[]"))
            return self._reserved.getsockname()[1]

    def deliver(self, key: str, value: bytes) -> bool:
        """Put `value` in the driver's job store: a rank's result goes home this way, on the
        job's authenticated channel, not through Spark's collect() and the driver's JVM
        heap.  False (nothing sent) where the job store is not the driver's."""
        if not self.on_driver:
            return False
        self._client().set(key, value)
        return True

    # -- Store, as the rank process sees it -----------------------------------
    def set(self, key, value):
        remote = self._job_store() if self.is_shared(key) else None
        if remote is None:
            super().set(key, value)
        else:
            remote.set(key, value)

    def get(self, key, timeout=None):
        self._await_carried(key)
        remote = self._job_store() if self.is_shared(key) else None
        return super().get(key, timeout) if remote is None else remote.get(key, timeout)

    def get_many(self, keys, timeout=None):
        keys = list(keys)
        shared = [self.is_shared(k) for k in keys]
        remote = self._job_store() if any(shared) else None
        if remote is None or not all(shared):  # (a mix: each key where it lives)
            return [self.get(k, timeout) for k in keys]
        return remote.get_many(keys, timeout)  # one request to the job store

    def add(self, key, amount):
        remote = self._job_store() if self.is_shared(key) else None
        return super().add(key, amount) if remote is None else remote.add(key, amount)

    def check(self, key):
        self._await_carried(key)
        remote = self._job_store() if self.is_shared(key) else None
        return super().check(key) if remote is None else remote.check(key)

    def delete(self, key):
        remote = self._job_store() if self.is_shared(key) else None
        if remote is None:
            super().delete(key)
        else:
            remote.delete(key)

    def close(self) -> None:
        if self._reserved is not None:
            self._reserved.close()
        for client in self._clients:
            client.close()
        super().close()  # shuts the listener down too, so accept() wakes
