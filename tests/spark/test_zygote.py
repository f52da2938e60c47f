"""The zygote and its owner (collectives.launch.zygote, horovod_spark._job.warm) with real processes.

A forked rank runs the real `collectives.launch.worker` under a keeper forked by the
zygote: it takes its function on its own channel, runs it and sends back its result
there, as a rank the Spark task starts fresh would.  No Spark here: tests/spark/test_warm_start.py
runs the same path under barrier tasks.
"""
from __future__ import annotations

import json
import socket
import os
import signal
import subprocess
import sys
import textwrap
import time

import cloudpickle
import psutil
import pytest

from _spark_support import alive_after

from collectives.launch import rank_envs
from collectives.launch.channel import LauncherEnd
from collectives.launch.record import RankResult
from collectives.rendezvous.store import StoreServer
from horovod_spark._job import warm

pytestmark = pytest.mark.timeout(120)

SECRET = b"z" * 32
TOKEN = b"t" * 32  # the session's token its zygotes prove (warm.session_token)
JOB = "zygote-test/a0"


@pytest.fixture
def store():
    server = StoreServer("127.0.0.1", 0, SECRET)
    yield server
    server.close()


@pytest.fixture
def owner():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    own = warm._Owner(sys.executable, env, ["numpy"], TOKEN)
    yield own, env
    own.close()
    if own.proc is not None:
        own.proc.wait(timeout=20)


def _rank_env(env: dict, store: StoreServer, rank: int = 0, size: int = 1) -> dict:
    renv = rank_envs(size, store.address, SECRET, JOB)[rank]
    return dict(env, **renv.to_environ(), HVS_WARM_REPORT=",".join(warm.REPORT))


def _spawn(owner, env, fn, store, *args):
    channel = LauncherEnd(SECRET, cloudpickle.dumps((fn, args, {})))
    child = owner.spawn(env, os.getcwd(), channel.rank_fd)
    assert child is not None, f"no warm start: {owner.dead}"
    channel.started()
    child.channel = channel
    return child


def _result(child) -> RankResult:
    child.channel.finish()
    assert child.channel.result is not None, "the rank sent no result on its channel"
    return RankResult.decode(child.channel.result)


def _facts(word):
    import os
    import random
    import sys
    print(f"out {word}", flush=True)
    print(f"err {word}", file=sys.stderr, flush=True)
    with open(f"/proc/{os.getppid()}/stat") as f:
        keeper_parent = int(f.read().rsplit(")", 1)[1].split()[1])
    return {"numpy": "numpy" in sys.modules, "pid": os.getpid(), "ppid": os.getppid(),
            "keeper_parent": keeper_parent, "word": os.environ.get("WARM_WORD"),
            "random": random.random(), "sid": os.getsid(0), "stdin": os.read(0, 1),
            "secret_in_env": any("HVS_SECRET" in k or "HVS_CHANNEL" in k for k in os.environ)}


def test_a_forked_rank_runs_its_function_with_its_own_environment(owner, store):
    own, env = owner
    results = []
    for word in ("one", "two"):
        child = _spawn(own, dict(_rank_env(env, store), WARM_WORD=word), _facts, store, word)
        out, err = child.stdout.read(), child.stderr.read()
        assert child.wait(timeout=30) == 0, err.decode()
        result = _result(child)
        assert result.ok, result.failure
        results.append((child.pid, result.value()))
        assert out.decode() == f"out {word}\n" and err.decode() == f"err {word}\n"
        assert child.channel.modules.decode().split(",") == ["numpy"]
    for word, (keeper, facts) in zip(("one", "two"), results):
        assert facts["numpy"] and facts["word"] == word
        assert facts["ppid"] == keeper and facts["keeper_parent"] == own.proc.pid  # zygote's
        assert facts["sid"] == keeper  # the keeper's session: killpg reaches the rank's children
        assert facts["stdin"] == b""  # /dev/null
        assert not facts["secret_in_env"]
    results = [facts for _, facts in results]
    assert results[0]["pid"] != results[1]["pid"]
    assert results[0]["random"] != results[1]["random"], "forks share the zygote's random state"


def _exit_with(code):
    import os
    os._exit(code)


def _kill_self():
    import os
    import signal
    os.kill(os.getpid(), signal.SIGKILL)


def test_exit_statuses_come_back_as_popen_returncodes(owner, store):
    own, env = owner
    child = _spawn(own, _rank_env(env, store), _exit_with, store, 7)
    assert child.wait(timeout=30) == 7
    child = _spawn(own, _rank_env(env, store), _kill_self, store)
    assert child.wait(timeout=30) == -signal.SIGKILL


def test_a_rank_without_its_environment_fails_like_a_fresh_one(owner, store):
    own, env = owner
    channel = LauncherEnd(SECRET, b"")
    child = own.spawn({k: v for k, v in env.items() if not k.startswith("HVS_")}, os.getcwd(),
                      channel.rank_fd)
    channel.started()
    assert child.wait(timeout=30) == 2
    channel.close()
    assert b"no rank environment" in child.stderr.read()


def _sleep():
    import time
    time.sleep(600)


def test_closing_the_owner_kills_the_zygote_and_its_ranks(owner, store):
    own, env = owner
    child = _spawn(own, _rank_env(env, store), _sleep, store)
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.2)
    own.close()
    assert child.wait(timeout=20) == -signal.SIGKILL
    assert own.proc.wait(timeout=20) == 0
    assert alive_after([child.pid, own.proc.pid]) == []
    assert own.spawn(_rank_env(env, store), os.getcwd(), 0) is None  # and it starts nothing


OWNER_SCRIPT = textwrap.dedent("""
    import os, sys, time, cloudpickle
    from collectives.launch import rank_envs
    from collectives.launch.channel import LauncherEnd
    from collectives.rendezvous.store import StoreServer
    from horovod_spark._job import warm
    store = StoreServer("127.0.0.1", 0, b"z" * 32)
    renv = rank_envs(1, store.address, b"z" * 32, "j/a0")[0]
    def sleep():
        import time
        time.sleep(600)
    channel = LauncherEnd(b"z" * 32, cloudpickle.dumps((sleep, (), {})))
    own = warm._Owner(sys.executable, dict(os.environ), ["numpy"], b"t" * 32)
    child = own.spawn(dict(os.environ, **renv.to_environ()), os.getcwd(), channel.rank_fd)
    channel.started()
    print(own.proc.pid, child.pid, flush=True)
    time.sleep(600)
""")


def test_a_killed_owner_takes_the_zygote_and_its_ranks_with_it():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.Popen([sys.executable, "-c", OWNER_SCRIPT], env=env, stdout=subprocess.PIPE,
                            text=True)
    try:
        zygote, child = map(int, proc.stdout.readline().split())
        assert psutil.Process(child).ppid() == zygote
        proc.kill()
        proc.wait(timeout=10)
        assert alive_after([zygote, child]) == []
    finally:
        proc.kill()


ANCHOR_SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    from horovod_spark._job import warm
    env = json.loads(sys.argv[1])
    if os.fork() == 0:  # a worker: it starts the shared zygote, waits for it, and is gone
        warm.learn(sys.executable, env, ["pyarrow"], b"t" * 32)
        warm._zygote.ready.wait(60)
        os._exit(0)
    os.wait()
    print("ready", flush=True)
    time.sleep(600)
""")


def test_a_shared_zygote_outlives_its_starter_serves_the_next_owner_and_dies_with_its_anchor(
        store):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    anchor = subprocess.Popen([sys.executable, "-c", ANCHOR_SCRIPT, json.dumps(env)], env=env,
                              stdout=subprocess.PIPE, text=True)
    own = None
    try:
        assert anchor.stdout.readline() == "ready\n"
        own = warm._attach(warm._key(sys.executable, env), anchor.pid, TOKEN)
        assert own is not None, "no zygote listens under its anchor after its starter exited"
        assert own.ready.wait(30) and own.modules == ["pyarrow"]
        assert warm._attach(warm._key(sys.executable, dict(env, OTHER="1")), anchor.pid,
                            TOKEN) is None
        other_session = b"o" * 32
        assert warm._attach(warm._key(sys.executable, env), anchor.pid, other_session) is None
        child = _spawn(own, _rank_env(env, store), _facts, store, "shared")
        assert child.wait(timeout=30) == 0, child.stderr.read().decode()
        zygote = _result(child).value()["keeper_parent"]
        assert "--listen" in psutil.Process(zygote).cmdline()
        asleep = _spawn(own, _rank_env(env, store), _sleep, store)
        own.close()  # an owner that lets go (a killed worker) takes its ranks, not the zygote
        assert alive_after([asleep.pid]) == []
        own = warm._attach(warm._key(sys.executable, env), anchor.pid, TOKEN)
        assert own is not None and psutil.Process(zygote).is_running()
        asleep = _spawn(own, _rank_env(env, store), _sleep, store)
        anchor.kill()
        anchor.wait(timeout=10)
        assert asleep.wait(timeout=20) == -signal.SIGKILL  # the zygote went, and its ranks
        assert alive_after([zygote, asleep.pid]) == []
    finally:
        anchor.kill()
        if own is not None:
            own.close()


def test_an_idle_zygote_exits_by_itself(store):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
               HOROVOD_SPARK_ZYGOTE_IDLE_S="0.5")
    own = warm._Owner(sys.executable, env, [], TOKEN)
    try:
        assert own.ready.wait(30)
        assert own.proc.wait(timeout=20) == 0
        deadline = time.monotonic() + 10
        while own.dead is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert own.dead == "the zygote exited"
        assert own.spawn(_rank_env(env, store), os.getcwd(), 0) is None
    finally:
        own.close()


def test_learn_keeps_a_zygote_only_for_heavy_fork_safe_modules():
    # the zygotes it lets go of go on listening for other workers until they idle
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
               HOROVOD_SPARK_ZYGOTE_IDLE_S="2")
    try:
        warm.learn(sys.executable, env, ["numpy", "tensorflow", "keras"], TOKEN)
        assert warm._zygote is None  # numpy is cheap; TensorFlow and Keras are never preloaded
        warm.learn(sys.executable, env, ["numpy", "pyarrow", "tensorflow"], TOKEN)
        first = warm._zygote
        assert first is not None and first.modules == ["numpy", "pyarrow"]
        warm.learn(sys.executable, dict(env, HVS_RANK="1", HVS_SECRET="00"), ["pyarrow"], TOKEN)
        assert warm._zygote is first  # same key (per-job variables aside), nothing new
        warm.learn(sys.executable, env, ["pandas"], TOKEN)
        assert warm._zygote is not first and first.dead is not None
        assert warm._zygote.modules == ["numpy", "pyarrow", "pandas"]  # the union, in order
        warm.learn(sys.executable, dict(env, WARM_TEST_KEY="other"), ["pyarrow"], TOKEN)
        assert warm._zygote.modules == ["pyarrow"]  # another key: a zygote of its own
    finally:
        warm.shutdown()
    assert warm._zygote is None


IMPOSTOR = os.path.join(os.path.dirname(__file__), "_zygote_impostor.py")


def start_impostor(name: str, mode: str, record, relay: str = "") -> subprocess.Popen:
    """A process of this user holding the zygote's `name` (see _zygote_impostor.py)."""
    proc = subprocess.Popen([sys.executable, IMPOSTOR, name, mode, str(record), relay],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "bound\n", "the impostor could not bind the name"
    return proc


def packets(record) -> list:
    """What the impostor received: (bytes, descriptors, what it read from a channel)."""
    if not record.exists():
        return []
    return [(bytes.fromhex(p["data"]), p["fds"], bytes.fromhex(p["channel"]))
            for p in map(json.loads, record.read_text().splitlines())]


@pytest.mark.parametrize("mode,text", [
    ("answer", "failed the proof"),    # the attack as it was: greets, as the old zygote did
    ("garbage", "failed the proof"),   # a guess at the proof
    ("relay", "failed the proof"),     # passes the proof on to a real zygote of the session
    ("silent", "gave no proof in 5 s"),
])
def test_a_process_holding_the_zygote_name_gets_no_byte_or_descriptor_of_a_job(
        tmp_path, mode, text):
    from collectives.launch.zygote_auth import PROOF_TIMEOUT_S

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    key, record = warm._key(sys.executable, env), tmp_path / "record"
    real = relay = None
    if mode == "relay":  # a real zygote of the session, on a name the impostor knows
        relay = f"hvs-test-real-zygote-{os.getpid()}-{time.monotonic_ns()}"
        real = warm._Owner(sys.executable, env, [], TOKEN, listen=(relay, os.getpid()))
        assert real.ready.wait(30)
    impostor = start_impostor(warm.address(key, os.getpid(), TOKEN), mode, record, relay or "")
    try:
        t0 = time.monotonic()
        with pytest.raises(warm.ZygoteUntrusted, match=text) as info:
            warm._attach(key, os.getpid(), TOKEN)
        assert time.monotonic() - t0 < PROOF_TIMEOUT_S + 3
        assert f"process {impostor.pid}" in str(info.value)  # the name's holder, named
        deadline = time.monotonic() + 10  # the impostor writes down what it got
        while not packets(record) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)  # anything after the hello would be written by now
        got = packets(record)
        assert [len(data) for data, _, _ in got] == [36], got  # our hello, nothing after it
        assert all(fds == 0 and channel == b"" for _, fds, channel in got)
        assert TOKEN not in got[0][0]
        # the name is not asked again in this process: no second hello, no wait
        t0 = time.monotonic()
        assert warm._attach(key, os.getpid(), TOKEN) is None
        assert time.monotonic() - t0 < 1 and len(packets(record)) == 1
    finally:
        warm._untrusted.clear()
        impostor.kill()
        impostor.wait(timeout=10)
        if real is not None:
            real.retire()
            assert real.proc.wait(timeout=20) == 0


def test_a_zygote_refuses_a_connection_that_does_not_hold_the_token(store):
    # the other direction: a process of this user that connects and guesses gets no greeting
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    name = f"hvs-test-zygote-{os.getpid()}-{time.monotonic_ns()}"
    own = warm._Owner(sys.executable, env, [], TOKEN, listen=(name, os.getpid()))
    try:
        assert own.ready.wait(30)
        for guess in (b"{\"spawn\": 1}", b"HVZ1" + b"n" * 32):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.connect("\0" + name)
            sock.settimeout(10)
            sock.send(guess)
            if guess.startswith(b"HVZ1"):  # it answers a hello; the wrong tag ends the talk
                assert len(sock.recv(128)) == 64
                sock.send(b"x" * 32)
            assert sock.recv(128) == b"", "the zygote said more to a peer without the token"
            sock.close()
        proved = warm._attach(warm._key(sys.executable, env), os.getpid(), TOKEN)
        assert proved is None  # another name: the test's zygote listens on `name`
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect("\0" + name)
        from collectives.launch.zygote_auth import prove_to_zygote
        prove_to_zygote(sock, TOKEN)
        sock.settimeout(10)
        assert json.loads(sock.recv(1 << 16))["ready"] == []  # proved: greeted
        sock.close()
    finally:
        own.retire()
        assert own.proc.wait(timeout=20) == 0


def test_a_forked_rank_holds_no_copy_of_the_token(owner, store):
    own, env = owner
    child = _spawn(own, _rank_env(env, store), _zygote_tokens, store)
    assert child.wait(timeout=30) == 0, child.stderr.read().decode()
    tokens = _result(child).value()
    assert tokens, "the forked rank has no copy of the zygote's state to look at"
    assert all(t == bytes(32) for t in tokens), "the rank inherited the session's token"


def _zygote_tokens():
    """The tokens of the zygote objects this process inherited by its fork."""
    import gc
    # the zygote runs as `python -m collectives.launch.zygote`: its class is __main__'s
    return [bytes(o.token) for o in gc.get_objects() if type(o).__name__ == "Zygote"]
