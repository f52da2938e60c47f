"""NCCL bootstrap through a real Store: one record per rank, rank 0's unique id, shared-GPU refusal."""
from __future__ import annotations

import os
import threading

import pytest

from collectives.backends._nccl_boot import bootstrap
from collectives.backends.base import Topology
from collectives.errors import CollectiveError, CollectiveTimeout, PeerLostError
from collectives.rendezvous.store import InMemoryStore


def _run_ranks(hosts, gpus, store=None, timeout=10.0, only=None):
    """bootstrap() on one thread per rank; returns each rank's unique id or exception."""
    store = store or InMemoryStore()
    size = len(hosts)
    results: dict = {}
    made = []

    def make_uid():
        made.append(1)
        return os.urandom(128)

    def rank_main(r):
        topo = Topology(rank=r, size=size, hosts=tuple(hosts))
        try:
            results[r] = bootstrap(store, topo, "job1/comm0", gpus[r], make_uid, timeout)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            results[r] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in (only or range(size))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results, store, len(made)


def test_every_rank_gets_rank_zeros_unique_id_from_one_record_each():
    results, store, made = _run_ranks(["a", "a", "b"], ["0000:01:00.0", "0000:02:00.0", "0000:01:00.0"])
    assert made == 1
    assert len({results[r] for r in range(3)}) == 1 and len(results[0]) == 128
    keys = sorted(k for k in store._data)  # the only keys set: one publication per rank
    assert keys == [f"job1/comm0/nccl/rank/{r}" for r in range(3)]


def test_the_bootstrap_runs_over_the_spark_tasks_store_as_a_shared_key():
    spark_store = pytest.importorskip("horovod_spark._job.spark_store")
    store = spark_store.SparkStore("127.0.0.1", os.urandom(32), "job1", 0, 1, lambda msg: [msg])
    try:
        assert store.is_shared("job1/comm0/nccl/rank/0")
        results, _, _ = _run_ranks(["a"], ["0000:01:00.0"], store=store)
        assert isinstance(results[0], bytes) and len(results[0]) == 128
    finally:
        store.close()


def test_ranks_sharing_a_gpu_are_refused_on_every_rank_before_nccl_starts():
    results, _, _ = _run_ranks(["a", "a", "a"], ["0000:01:00.0", "0000:02:00.0", "0000:01:00.0"])
    messages = {str(results[r]) for r in range(3)}
    assert all(isinstance(results[r], CollectiveError) for r in range(3))
    assert len(messages) == 1, messages  # the same words on every rank
    assert "ranks 0, 2 on host a share GPU 0000:01:00.0" in messages.pop()


def test_a_rank_that_never_publishes_is_named_after_the_timeout():
    results, _, _ = _run_ranks(["a", "b"], ["x", "y"], timeout=0.5, only=[0])
    err = results[0]
    assert isinstance(err, CollectiveTimeout)
    assert "nccl init on rank 0/2: no NCCL bootstrap record (peer rank 1) after 0.5 s" in str(err)


def test_a_malformed_unique_id_from_rank_zero_is_refused():
    store = InMemoryStore()
    store.set("job1/comm0/nccl/rank/0", b'{"host": "a", "gpu": "0", "uid": "abcd"}')
    topo = Topology(rank=1, size=2, hosts=("a", "b"))
    with pytest.raises(CollectiveError, match="rank 0's NCCL unique id has 2 bytes, not 128"):
        bootstrap(store, topo, "job1/comm0", "1", lambda: b"", 5.0)


class _StuckNccl:
    """Stands in for cupy.cuda.nccl (not ours) where ncclCommInitRank waits for a rank that
    never comes, as NCCL's blocking init does; `release` lets the abandoned thread end."""

    class NcclError(Exception):
        pass

    def __init__(self):
        self.release = threading.Event()
        outer = self

        class NcclCommunicator:
            def __init__(self, size, uid, rank):
                outer.release.wait(30)

        self.NcclCommunicator = NcclCommunicator


class _Cupy:
    class cuda:  # noqa: N801 - the shape of cupy.cuda
        @staticmethod
        def Device(index):  # noqa: N802
            import contextlib

            return contextlib.nullcontext()


@pytest.mark.timeout(30)
def test_an_nccl_init_that_a_rank_never_joins_fails_within_the_connect_timeout():
    from collectives.backends.nccl import _init_comm

    nccl = _StuckNccl()
    try:
        with pytest.raises(CollectiveTimeout) as info:
            _init_comm(_Cupy, nccl, 0, Topology(rank=1, size=2, hosts=("a", "a")), bytes(128), 0.5)
    finally:
        nccl.release.set()
    text = str(info.value)
    assert "ncclCommInitRank did not finish" in text and "rank 1/2" in text and "0.5" in text, text


class _NcclTaking:
    """The NcclCommunicator of a CuPy that takes one form of unique id (see _nccl_types.
    unique_id_forms): bytes (CuPy 14), signed or unsigned chars (CuPy 13 on x86 / ARM)."""

    class NcclError(Exception):
        pass

    def __init__(self, form: str, fail_with=None):
        self.form, self.fail_with, self.got = form, fail_with, None
        outer = self

        class NcclCommunicator:
            def __init__(self, ndev, uid, rank):
                if isinstance(uid, bytes) != (outer.form == "bytes"):
                    raise TypeError("Argument 'commId' has incorrect type")
                if outer.form == "unsigned" and min(uid) < 0:
                    raise OverflowError("can't convert negative value to unsigned char")
                if outer.form == "signed" and max(uid) > 127:
                    raise OverflowError("value too large to convert to char")
                if outer.fail_with is not None:
                    raise outer.fail_with
                outer.got = uid

        self.NcclCommunicator = NcclCommunicator


UID = bytes((i * 37) % 256 for i in range(128))  # bytes above 127 too


@pytest.mark.parametrize("form", ["bytes", "signed", "unsigned"])
def test_the_unique_id_goes_in_the_form_this_cupy_takes(form):
    from collectives.backends.nccl import _init_comm

    nccl = _NcclTaking(form)
    _init_comm(_Cupy, nccl, 0, Topology(rank=0, size=2, hosts=("a", "a")), UID, 5.0)
    assert bytes(b & 0xFF for b in nccl.got) == UID


def test_an_nccl_status_an_old_cupy_does_not_know_is_named_not_a_key_error():
    """CuPy < 13.4 builds its NcclError from a table of statuses 0-5 and raises KeyError(6)
    for ncclRemoteError, the status of a peer that died."""
    from collectives.backends.nccl import _init_comm

    nccl = _NcclTaking("bytes", fail_with=KeyError(6))
    with pytest.raises(PeerLostError) as info:
        _init_comm(_Cupy, nccl, 0, Topology(rank=1, size=2, hosts=("a", "a")), UID, 5.0)
    assert "ncclRemoteError (6)" in str(info.value) and "rank 1/2" in str(info.value)
