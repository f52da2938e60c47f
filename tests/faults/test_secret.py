"""The attacker of a shared executor: a process of the same user, not of the job.

It first looks for the job's secret in every process's environment and command line
(the kernel's copy, /proc/<pid>/environ, which outlives os.environ.pop), and finds
nothing.  Given the secret by hand, it writes a forged result for rank 0 wherever a
store takes it and kills rank 0: the job fails naming rank 0 and its signal, and the
forged pickle is never loaded.  Without the task key it cannot reach the driver's
servers at all.  Beside it: what a rank starts in a session of its own ends with the job,
a value the driver cannot load is named with its rank, and the mesh listener holds a
bounded number of pending handshakes.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import cloudpickle
import psutil
import pytest

import _fault_attacks as attacks
import _fault_kit as kit
import _secret_ranks as secret_ranks
from collectives.errors import AuthenticationError
from collectives.rendezvous.store import TCPStore

pytestmark = pytest.mark.timeout(240)

#: Run as a process of its own: every process whose environment or command line holds
#: the secret (hex, either case, or raw), and how many processes it could read.
SCANNER = r"""
import json, os, sys
secret = bytes.fromhex(sys.stdin.read().strip())  # not in its own command line
needles = [secret.hex().encode(), secret.hex().upper().encode(), secret]
found, read = [], []
for pid in (p for p in os.listdir("/proc") if p.isdigit()):
    for what in ("environ", "cmdline"):
        try:
            with open(f"/proc/{pid}/{what}", "rb") as f:
                data = f.read()
        except OSError:
            continue
        read.append(int(pid))
        if any(n in data for n in needles):
            found.append([int(pid), what])
print(json.dumps({"found": found, "read": sorted(set(read))}))
"""


def scan_for(secret_hex: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SCANNER], input=secret_hex, capture_output=True,
                         text=True, check=True, timeout=60)
    return json.loads(out.stdout)


def _job_processes(pids) -> list:
    """The ranks, their keepers, the keepers' launchers, and what the ranks started."""
    out = set()
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            keeper = psutil.Process(proc.ppid())
            out.update([pid, keeper.pid, keeper.ppid(),
                        *(c.pid for c in proc.children(recursive=True))])
        except psutil.NoSuchProcess:
            pass
    return sorted(out - {os.getpid()})


def _in_thread(fn):
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # the job's failure is the result under test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def _alive(pids) -> list:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _forge(store_addr: str, job: str, secret_hex: str, target) -> None:
    """What the attacker does with the secret: plant a result for rank 0 that would run
    code wherever it is unpickled, under every key a launcher or a driver might read."""
    store = TCPStore.connect(store_addr, bytes.fromhex(secret_hex), timeout=10)
    try:
        forged = b"ok\n" + cloudpickle.dumps(attacks.Bomb(str(target)))
        for key in ("result/0", "delivered/0"):
            store.set(f"{job}/{key}", forged)
    finally:
        store.close()


def _attack(fault, runner, target):
    """Run a job whose rank 0 is held; scan, forge, kill rank 0; return (scan, job outcome)."""
    thread, box = _in_thread(runner)
    try:
        notes = kit.wait_until(lambda: len(kit.notes(fault.outdir, "rank")) == 2 and
                               kit.notes(fault.outdir, "rank"), 120, "both ranks note")
        rank0 = notes[0]
        scan = scan_for(rank0["secret"])
        scan["job"] = _job_processes([n["pid"] for n in notes.values()])
        env = psutil.Process(rank0["pid"]).environ()  # where the attacker learns the store
        _forge(env["HVS_STORE_ADDR"], env["HVS_JOB"], rank0["secret"], target)
        os.kill(rank0["pid"], signal.SIGKILL)
        thread.join(120)
    finally:
        open(os.path.join(fault.outdir, "go"), "w").close()
        thread.join(30)
    assert not thread.is_alive(), "the job did not end after its rank 0 was killed"
    return scan, box


def _assert_nothing_found(scan: dict) -> None:
    assert not scan["found"], f"the secret is in these processes' /proc files: {scan['found']}"
    unread = sorted(set(scan["job"]) - set(scan["read"]))
    assert not unread, f"the scanner could not read the job's processes {unread}"


def _assert_rank0_killed(box: dict, target) -> None:
    assert "error" in box, f"the job returned {box.get('value')!r} though rank 0 was killed"
    err = box["error"]
    assert err.rank == 0 and err.exitcode == -signal.SIGKILL, err
    assert "SIGKILL" in str(err), err
    assert not target.exists(), "a forged result was unpickled"


def test_the_attack_on_a_local_job_finds_no_secret_and_its_forged_result_is_never_loaded(
        fault, tmp_path):
    from collectives.launch import run_local

    target = tmp_path / "unpickled"
    scan, box = _attack(fault, lambda: run_local(
        secret_ranks.hold, 2, args=(fault.outdir, (0,)), env=fault.env(),
        stdout=attacks.Discard(), stderr=attacks.Discard(), timeout=120), target)
    _assert_nothing_found(scan)
    _assert_rank0_killed(box, target)


@pytest.mark.spark
@pytest.mark.slow
def test_the_attack_on_a_spark_job_finds_no_secret_and_cannot_reach_the_driver(
        spark, fault, tmp_path):
    import horovod_spark

    target = tmp_path / "unpickled"
    before = {tuple(a) for a in _listening(os.getpid())}
    refused = {}

    def runner():
        return horovod_spark.run(secret_ranks.hold, args=(fault.outdir, (0,)), num_proc=2,
                                 env=fault.env(), stdout=attacks.Discard(),
                                 stderr=attacks.Discard(), verbose=0)

    def try_the_driver():  # while the job runs: its servers refuse the job's secret
        notes = kit.wait_until(lambda: len(kit.notes(fault.outdir, "rank")) == 2 and
                               kit.notes(fault.outdir, "rank"), 120, "both ranks note")
        secret = bytes.fromhex(notes[0]["secret"])
        for addr in {tuple(a) for a in _listening(os.getpid())} - before:
            for context in ("store", "log"):
                refused[(addr, context)] = isinstance(
                    attacks.attack_with_secret(f"{addr[0]}:{addr[1]}", secret, context),
                    AuthenticationError)

    prober = threading.Thread(target=try_the_driver, daemon=True)
    prober.start()
    scan, box = _attack(fault, runner, target)
    prober.join(60)
    _assert_nothing_found(scan)
    _assert_rank0_killed(box, target)
    assert refused and all(refused.values()), f"the driver took the job's secret: {refused}"


def _listening(pid: int) -> list:
    return [c.laddr for c in psutil.Process(pid).net_connections("tcp")
            if c.status == psutil.CONN_LISTEN]


def test_what_a_rank_starts_in_a_session_of_its_own_ends_with_the_job(fault):
    from collectives.launch import run_local

    assert run_local(secret_ranks.hold, 2, args=(fault.outdir, (), 10.0, True),
                     env=fault.env(), stdout=attacks.Discard(), stderr=attacks.Discard(),
                     timeout=120) == [0, 1]
    started = [n[k] for n in kit.notes(fault.outdir, "rank").values()
               for k in ("kid", "detached", "daemon")]
    assert len(started) == 6
    assert kit.wait_until(lambda: not _alive(started), 10, "the ranks' descendants end")


def test_what_a_killed_rank_started_in_a_session_of_its_own_ends_with_it(fault):
    out = kit.run_local_job(secret_ranks.die_after_starting_descendants, 2,
                            args=(fault.outdir,), env=fault.env(), outdir=fault.outdir)
    assert out.error is not None and out.error.rank == 0, out.error
    notes = kit.notes(fault.outdir, "rank")
    started = [n[k] for n in notes.values() for k in ("kid", "detached", "daemon") if k in n]
    assert started, "no rank noted what it started"
    assert kit.wait_until(lambda: not _alive(started), 10, "the ranks' descendants end")


@pytest.mark.spark
@pytest.mark.slow
def test_on_spark_what_ranks_start_in_sessions_of_their_own_ends_with_the_job(spark, fault):
    import horovod_spark

    env = dict(fault.env(), HOROVOD_SPARK_WARM_START="1")  # fresh and forked ranks alike
    for attempt in range(2):
        outdir = os.path.join(fault.outdir, str(attempt))
        os.makedirs(outdir)
        assert horovod_spark.run(secret_ranks.hold, args=(outdir, (), 10.0, True),
                                 num_proc=2, env=env, verbose=0) == [0, 1]
        started = [n[k] for n in kit.notes(outdir, "rank").values()
                   for k in ("kid", "detached", "daemon")]
        assert kit.wait_until(lambda: not _alive(started), 10, "the ranks' descendants end")


def test_a_value_the_launcher_cannot_load_is_named_with_its_rank(tmp_path):
    from horovod_spark import HorovodRunner
    from horovod_spark._job.failure import JobFailedError

    with pytest.raises(JobFailedError) as info:
        HorovodRunner(np=-2).run(secret_ranks.return_a_class_only_the_rank_has,
                                 moddir=str(tmp_path / "rank-only"))
    err = info.value
    assert err.rank == 0 and err.error_type == "ResultNotLoadable", err
    assert "hvs_rank_only_module" in str(err) and "install it where the job was started" in str(err)


@pytest.mark.spark
def test_on_spark_a_value_the_driver_cannot_load_is_named_with_its_rank(spark, tmp_path):
    from horovod_spark import HorovodRunner
    from horovod_spark._job.failure import JobFailedError

    with pytest.raises(JobFailedError) as info:
        HorovodRunner(np=2).run(secret_ranks.return_a_class_only_the_rank_has,
                                moddir=str(tmp_path / "rank-only"))
    err = info.value
    assert err.rank == 0 and err.error_type == "ResultNotLoadable", err
    assert "ModuleNotFoundError" in str(err) and "hvs_rank_only_module" in str(err)


@pytest.mark.slow
def test_a_flood_of_silent_connections_to_a_ranks_listener_holds_a_bounded_number(fault):
    from collectives.rendezvous.accept import MAX_PENDING

    group, store = attacks.held_job(fault, 2, (1,), os.urandom(32), connect_timeout=30.0)
    with group:
        rank0 = psutil.Process(kit.wait_until(lambda: kit.notes(fault.outdir, "pid").get(0),
                                              60, "rank 0 notes")["pid"])
        address = attacks.rank0_listener(fault, group, store)
        threads = rank0.num_threads()
        crowd = attacks.SilentClients(address, 3 * MAX_PENDING)
        try:
            kit.wait_until(lambda: rank0.num_threads() >= threads + MAX_PENDING // 2, 30,
                           "rank 0 takes the crowd")
            grown = max(rank0.num_threads() for _ in range(50))
            results, codes = attacks.finish_held(fault, group)
        finally:
            crowd.close()
    assert grown - threads <= MAX_PENDING + 2, f"rank 0 ran {grown - threads} handshakes at once"
    assert codes == [0, 0], kit.notes(fault.outdir, "error")
