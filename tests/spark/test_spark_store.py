"""The Spark Store over real TCP: private keys stay, shared keys meet at rank 0's task store.

Tasks are threads here, with an allGather that has Spark's semantics (every task
sends one string, every task gets all of them in rank order); the Spark modules run
the same store on real barrier tasks.
"""
from __future__ import annotations

import json
import os
import threading
import time

import pytest

import _spark_support  # noqa: F401  (puts the repository on sys.path)

from collectives.errors import CollectiveError
from collectives.rendezvous.store import InMemoryStore, StoreServer, TCPStore
from horovod_spark._job.spark_store import SparkStore

SECRET = os.urandom(32)
JOB = "hvs-0123/a0"
pytestmark = pytest.mark.timeout(60)


class AllGather:
    """BarrierTaskContext.allGather for n tasks that are threads of this process."""

    def __init__(self, n: int) -> None:
        self._barrier, self._slots = threading.Barrier(n, timeout=30), [None] * n
        self.calls = 0

    def of(self, rank: int):
        def all_gather(message: str) -> list:
            self._slots[rank] = message
            self.calls += 1
            self._barrier.wait()
            replies = list(self._slots)
            self._barrier.wait()
            return replies
        return all_gather


@pytest.fixture
def stores():
    gather = AllGather(3)
    servers = [SparkStore("127.0.0.1", SECRET, JOB, r, 3, gather.of(r)) for r in range(3)]
    clients = [TCPStore.connect(s.address, SECRET) for s in servers]
    yield servers, clients, gather
    for c in clients:
        c.close()
    for s in servers:
        s.close()


def test_every_rank_reads_every_ranks_publication(stores):
    servers, clients, gather = stores
    results = [None] * 3

    def rank_main(r):
        clients[r].set(f"{JOB}/comm0/mesh/rank/{r}", f"addr-{r}".encode())
        results[r] = [clients[r].get(f"{JOB}/comm0/mesh/rank/{p}", 10) for p in range(3)]

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [[b"addr-0", b"addr-1", b"addr-2"]] * 3
    assert [s.rounds for s in servers] == [1, 1, 1] and gather.calls == 3


def test_a_key_one_rank_sets_reaches_the_ranks_that_wait_for_it(stores):
    _, clients, _ = stores
    got = []
    waiter = threading.Thread(target=lambda: got.append(clients[2].get(f"{JOB}/comm0/shm/0", 10)))
    waiter.start()
    adder = threading.Thread(target=lambda: clients[1].add(f"{JOB}/comm0/count", 1))
    adder.start()
    clients[0].set(f"{JOB}/comm0/shm/0", b"/hvs-segment")
    waiter.join(30)
    adder.join(30)
    assert got == [b"/hvs-segment"]
    assert clients[0].add(f"{JOB}/comm0/count", 1) == 2  # counters are shared too


def test_a_delivered_key_is_never_forwarded_to_the_job_store_and_needs_no_round(stores):
    servers, clients, gather = stores
    clients[1].set(f"{JOB}/delivered/0", b"a result forged for rank 0")
    assert servers[1].check(f"{JOB}/delivered/0") and not servers[0].check(f"{JOB}/delivered/0")
    assert gather.calls == 0


def _a_get_fails(store: SparkStore, match: str) -> None:
    """A rank's get of a shared key fails with `match`; the store is closed after."""
    client = TCPStore.connect(store.address, SECRET)
    try:
        with pytest.raises(CollectiveError, match=match):
            client.get(f"{JOB}/comm0/mesh/rank/0", 5)
    finally:
        client.close()
        store.close()


def test_a_round_that_never_completes_fails_the_request_naming_init():
    never = threading.Event()
    store = SparkStore("127.0.0.1", SECRET, JOB, 1, 2, lambda msg: never.wait() or [],
                       round_timeout=0.5)
    try:
        _a_get_fails(store, r"rendezvous on rank 1/2: the store round .* after 0\.5 s; does "
                            r"every rank call collectives.init\(\)")
    finally:
        never.set()


def test_a_round_answered_by_another_job_is_refused():
    def other_job(msg):
        mine = json.loads(msg)
        return [json.dumps(dict(mine, job="hvs-other/a0", rank=0)), msg]

    store = SparkStore("127.0.0.1", SECRET, JOB, 1, 2, other_job)
    client = TCPStore.connect(store.address, SECRET)
    try:
        with pytest.raises(CollectiveError, match="task 0 answered the store round for job "
                                                  "'hvs-other/a0'"):
            client.set(f"{JOB}/comm0/mesh/rank/1", b"x")
    finally:
        client.close()
        store.close()


def test_a_client_without_the_secret_never_reaches_the_store(stores):
    servers, _, _ = stores
    with pytest.raises(CollectiveError):
        TCPStore.connect(servers[0].address, os.urandom(32), timeout=2).set(f"{JOB}/x", b"1")
    assert not servers[0].check(f"{JOB}/x")


def _no_round(msg):
    raise AssertionError("allGather was called although the driver serves the job store")


def test_with_a_driver_store_the_ranks_meet_there_without_a_round():
    driver = StoreServer("127.0.0.1", 0, SECRET)
    servers = [SparkStore("127.0.0.1", SECRET, JOB, r, 2, _no_round, job_store=driver.address)
               for r in range(2)]
    clients = [TCPStore.connect(s.address, SECRET) for s in servers]
    try:
        got = []
        waiter = threading.Thread(target=lambda: got.append(clients[1].get(f"{JOB}/comm0/k", 10)))
        waiter.start()
        clients[0].set(f"{JOB}/comm0/k", b"from rank 0")
        waiter.join(10)
        assert got == [b"from rank 0"]
        assert clients[0].add(f"{JOB}/comm0/n", 1) + clients[1].add(f"{JOB}/comm0/n", 1) == 3
        assert driver.check(f"{JOB}/comm0/k")  # held by the driver ...
        assert not any(InMemoryStore.check(s, f"{JOB}/comm0/k") for s in servers)  # ... only
        clients[0].set(f"{JOB}/delivered/0", b"only a task delivers to the driver")
        assert not driver.check(f"{JOB}/delivered/0") and servers[0].check(f"{JOB}/delivered/0")
        assert [s.rounds for s in servers] == [0, 0]
    finally:
        for c in clients:
            c.close()
        for s in servers:
            s.close()
        driver.close()


def test_an_unreachable_driver_store_is_named_with_the_switch():
    import socket
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        address = "127.0.0.1:%d" % probe.getsockname()[1]
    store = SparkStore("127.0.0.1", SECRET, JOB, 1, 2, _no_round, job_store=address,
                       connect_timeout=0.5)
    _a_get_fails(store, r"rendezvous on rank 1/2: cannot reach the job's rendezvous store on "
                        r"the driver.*HOROVOD_SPARK_RENDEZVOUS=spark")


def test_what_a_task_shares_travels_in_the_round_and_outlives_rank_0s_store():
    """TF ports (`share`) ride in the round's messages: every task store holds every task's
    value, so a rank reads them after rank 0's task has ended; a forwarded key then fails at
    once (rank 0's store listened before the round, so a refusal means it is gone)."""
    gather = AllGather(2)
    servers = [SparkStore("127.0.0.1", SECRET, JOB, r, 2, gather.of(r), connect_timeout=30.0)
               for r in range(2)]
    try:
        for r, server in enumerate(servers):
            server.share(f"{JOB}/tf/worker/{r}", f"127.0.0.1:{4000 + r}".encode())
        with pytest.raises(ValueError, match="not a key the round carries"):
            servers[0].share(f"{JOB}/comm0/x", b"")
        ports = [servers[r].master_port() for r in range(2)]  # starts each task's round
        assert ports[0] == ports[1]
        servers[0].close()  # rank 0's function returned at once
        client = TCPStore.connect(servers[1].address, SECRET)
        try:
            assert client.get_many([f"{JOB}/tf/worker/{r}" for r in range(2)], 10) == \
                [b"127.0.0.1:4000", b"127.0.0.1:4001"]
            began = time.monotonic()
            with pytest.raises(CollectiveError):
                client.set(f"{JOB}/comm0/mesh/rank/1", b"{}")
            assert time.monotonic() - began < 10  # not the 30 s connect timeout
        finally:
            client.close()
        with pytest.raises(RuntimeError, match="after the round"):
            servers[1].share(f"{JOB}/tf/worker/1", b"")
    finally:
        for server in servers:
            server.close()
