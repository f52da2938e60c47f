"""Network faults: a connection reset mid-transfer, peers and servers that accept and never
answer, and a driver that dies under its ranks.  The mesh runs on TCP here
(HOROVOD_SPARK_FORCE_TCP=1): every rank is its own host."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import _fault_attacks as attacks
import _fault_kit as kit
import _fault_ranks as ranks
from conftest import TIMEOUT


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.2, 0.7])
def test_a_connection_reset_mid_transfer_fails_every_rank_with_the_peer_named(fault, delay):
    out = kit.run_local_job(ranks.train_and_reset, 3, args=(fault.outdir, 1, delay),
                            env=fault.env(tcp=True), outdir=fault.outdir)
    assert out.error is not None, out.value
    assert kit.notes(fault.outdir, "killed")[1]["where"] == "reset mesh connections"
    assert out.detect_s < TIMEOUT, out.detect_s
    errors = out.notes("error")
    assert sorted(errors) == [0, 1, 2], errors
    for r, e in errors.items():
        assert e["type"] == "PeerLostError" and f"on rank {r}/3" in e["message"], e
        assert "peer rank" in e["message"], e
    assert any("reset by peer (peer rank 1 " in errors[r]["message"] for r in (0, 2)), errors
    assert not kit.wait_gone(fault.tag)[1]


BOOTSTRAP_DEADLINE = ("_mesh._connect_peer gives each attempt a fixed 10 s handshake timeout "
                      "(and create_connection 5 s), so a peer that accepts and never answers "
                      "is reported after 10 s whatever connect_timeout says (collectives/rendezvous/mesh.py; "
                      "fix: timeout=min(10.0, max(deadline - time.monotonic(), 0.1)) for both)")


@pytest.mark.slow
def test_a_peer_that_accepts_and_never_answers_fails_bootstrap_at_the_connect_timeout(fault):
    connect = 3.0
    out = kit.run_local_job(ranks.silent_rank0, 3, args=(fault.outdir, 30.0),
                            env=fault.env(tcp=True, connect_timeout=connect), outdir=fault.outdir)
    assert out.error is not None and "peer rank 0" in str(out.error), out.error
    errors, pids = out.notes("error"), out.notes("pid")
    for r in (1, 2):
        assert errors[r]["type"] in ("PeerLostError", "CollectiveTimeout"), errors[r]
        took = errors[r]["t"] - pids[r]["t"]
        assert took < connect + 2.0, f"rank {r} gave up {took:.1f} s into bootstrap"
    assert 0 in pids
    assert not kit.wait_gone(fault.tag)[1]


def test_a_store_that_accepts_and_never_answers_is_refused_within_the_timeout():
    from collectives.rendezvous.store import TCPStore

    silent = attacks.SilentServer()
    try:
        t0 = time.monotonic()
        with pytest.raises(Exception) as info:
            TCPStore.connect(silent.address, os.urandom(32), timeout=1.0)
        took = time.monotonic() - t0
    finally:
        silent.close()
    assert type(info.value).__name__ in ("AuthenticationError", "PeerLostError"), info.value
    assert took < 1.0 + 2.0, f"gave up after {took:.1f} s with a 1 s timeout"


def test_a_log_server_that_never_answers_drops_lines_and_never_fails_the_task():
    from horovod_spark._job.logchannel import LogClient

    silent = attacks.SilentServer()
    try:
        client = LogClient(silent.address, os.urandom(32), "job", 0, connect_timeout=0.5)
        for i in range(100):
            client.line("stdout", f"line {i}")
        client.failure({"rank": 0, "error_type": "X"})
        t0 = time.monotonic()
        client.close(timeout=2.0)
        took = time.monotonic() - t0
    finally:
        silent.close()
    assert client.broken
    assert took < 2.0 * 2 + 1.0, f"close() took {took:.1f} s"


DRIVER = textwrap.dedent("""
    import sys
    sys.path[:0] = {path!r}
    import _fault_ranks as ranks
    from collectives.launch import run_local
    run_local(ranks.train_and_die, 3, args=({outdir!r}, -1, 0.0), env={env!r})
""")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_ranks_die_with_their_driver(fault, sig):
    """The driver process itself killed mid-training: no rank outlives it."""
    code = DRIVER.format(path=sys.path, outdir=fault.outdir, env=fault.env(tcp=True))
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        kit.wait_until(lambda: len(kit.notes(fault.outdir, "pid")) == 3, 60.0, "3 ranks start")
        assert len(kit.tagged(fault.tag, keepers=False)) == 3
        driver.send_signal(sig)
        driver.wait(timeout=30)
        seconds, left = kit.wait_gone(fault.tag, timeout=10.0)
        assert not left, f"{len(left)} rank processes outlived their driver by {seconds:.1f} s"
        pids = [n["pid"] for n in kit.notes(fault.outdir, "pid").values()]
        assert kit.shm_segments(pids) == []
    finally:
        driver.kill()
        driver.wait()
