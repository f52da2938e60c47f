"""Bootstrap of the mesh and the local launcher, with real processes and sockets."""
import os
import signal
import socket
import sys
import threading
import time

import psutil
import pytest

from collectives.rendezvous import auth
from collectives.rendezvous.mesh import build_mesh
from collectives.errors import CollectiveTimeout
from collectives.launch import RankFailed, run_local
from collectives.rendezvous.store import InMemoryStore

SECRET = b"k" * 32


def _mesh_world(size, **kw):
    store, out, errs = InMemoryStore(), {}, []

    def rank(r):
        try:
            out[r] = build_mesh(store, r, size, "h", "127.0.0.1", SECRET, "t", 10.0, **kw)
        except Exception as exc:  # surfaced by the assertion below
            errs.append(exc)

    ts = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    [t.start() for t in ts]
    [t.join(20) for t in ts]
    assert not errs, errs
    return out


def test_ranks_of_one_host_hold_no_tcp_link():
    for m in _mesh_world(4).values():
        assert m.socks == {} and m.topology.local_size == 4  # shared memory carries it all
        m.close()


@pytest.mark.parametrize("size", [2, 5, 8])
def test_the_mesh_links_the_pairs_of_the_plan_with_the_right_peer(size):
    from collectives.rendezvous.plan import link_peers

    meshes = _mesh_world(size, force_tcp=True)
    groups = [f"h#{r}" for r in range(size)]
    for r, m in meshes.items():
        assert sorted(m.socks) == link_peers(r, groups)
        for p in m.socks:
            assert r in meshes[p].socks  # both ends hold it
    for r, m in meshes.items():  # a byte sent on r's socket to p arrives on p's from r
        for p, sock in m.socks.items():
            sock.sendall(bytes([r]))
    for r, m in meshes.items():
        for p, sock in m.socks.items():
            assert sock.recv(1) == bytes([p])
    for m in meshes.values():
        m.close()


def test_connect_all_links_the_pairs_the_plan_left_out():
    from collectives.rendezvous.plan import link_peers

    meshes = _mesh_world(6, force_tcp=True)
    added = {}

    def rank(r):
        added[r] = meshes[r].connect_all()

    ts = [threading.Thread(target=rank, args=(r,)) for r in range(6)]
    [t.start() for t in ts]
    [t.join(20) for t in ts]
    for r, m in meshes.items():
        assert sorted(m.socks) == [p for p in range(6) if p != r]
        assert set(added[r]) == {p for p in range(6) if p != r} - set(
            link_peers(r, [f"h#{q}" for q in range(6)]))
    meshes[0].socks[5].sendall(b"x")
    assert meshes[5].socks[0].recv(1) == b"x"
    for m in meshes.values():
        m.close()


def test_force_tcp_makes_every_rank_its_own_host():
    meshes = _mesh_world(3, force_tcp=True)
    assert all(m.topology.local_size == 1 and m.topology.cross_size == 3 for m in meshes.values())


def test_a_stray_connection_with_a_wrong_secret_does_not_break_bootstrap():
    store = InMemoryStore()
    result = {}
    intruder_done = threading.Event()

    def intruder():
        import json
        info = json.loads(store.get("t/mesh/rank/0", 10))
        s = socket.create_connection((info["addr"], info["port"]))
        try:
            auth.client_handshake(s, b"w" * 32, "mesh", 5)
        except Exception:
            pass  # refused, as it must be: the server hung up after rejecting it
        s.close()
        intruder_done.set()

    def rank(r):
        if r == 1:
            assert intruder_done.wait(20)  # the intruder comes first
        result[r] = build_mesh(store, r, 2, "h", "127.0.0.1", SECRET, "t", 10.0, force_tcp=True)

    ts = [threading.Thread(target=rank, args=(r,)) for r in range(2)] + [threading.Thread(target=intruder)]
    [t.start() for t in ts]
    [t.join(20) for t in ts]
    assert sorted(result) == [0, 1]
    assert result[0].rejected == 1


def test_a_rank_that_never_arrives_times_out_naming_it():
    with pytest.raises(CollectiveTimeout, match="peer rank 1"):
        build_mesh(InMemoryStore(), 0, 2, "h", "127.0.0.1", SECRET, "t", 0.5)


def _whoami(offset):
    return int(os.environ["HVS_RANK"]) + offset, int(os.environ["HVS_SIZE"])


def test_run_local_returns_every_rank_value_in_rank_order():
    assert run_local(_whoami, 3, args=(10,)) == [(10, 3), (11, 3), (12, 3)]


def _fail_on_rank_1():
    if os.environ["HVS_RANK"] == "1":
        print("about to fail", flush=True)
        raise KeyError("bad key on rank one")
    time.sleep(30)


def test_an_exception_names_the_rank_with_its_traceback_and_output():
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_local(_fail_on_rank_1, 2, timeout=60)
    err = info.value
    assert err.rank == 1 and err.error_type == "KeyError"
    assert "bad key on rank one" in str(err) and "_fail_on_rank_1" in err.remote_traceback
    assert "about to fail" in err.output_tail
    assert isinstance(err.original(), KeyError)
    assert time.monotonic() - t0 < 20  # the sleeping rank was killed, not waited for


def _exit_3():
    if os.environ["HVS_RANK"] == "0":
        os._exit(3)
    time.sleep(30)


def test_os_exit_is_named_with_its_exit_status():
    with pytest.raises(RankFailed, match=r"rank 0 failed \(exit status 3\)"):
        run_local(_exit_3, 2, timeout=60)


def _sigkill_self():
    if os.environ["HVS_RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(30)


def test_sigkill_is_named_and_no_rank_process_is_left_behind():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(RankFailed, match="rank 1 failed .killed by SIGKILL"):
        run_local(_sigkill_self, 3, timeout=60)
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before


def _chatty():
    print(f"hello from {os.environ['HVS_RANK']}", flush=True)
    return 0


def test_output_is_forwarded_prefixed_by_rank(capfd):
    import io
    buf = io.StringIO()
    run_local(_chatty, 2, stdout=buf)
    text = buf.getvalue()
    assert "[0]<stdout>:hello from 0" in text and "[1]<stdout>:hello from 1" in text


def test_bad_arguments_are_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="positive number of ranks"):
        run_local(_chatty, 0)
    with pytest.raises(TypeError, match="callable"):
        run_local(42, 2)
    lock = threading.Lock()
    with pytest.raises(TypeError, match="cannot be pickled"):
        run_local(lambda: lock, 2)


def test_ranks_start_under_a_parent_with_live_grpc_threads():
    """A Spark Connect client's gRPC in the launching process: starting ranks with a
    preexec_fn forked them with gRPC's fork handlers, which aborted some before they ran
    (5 of 60 here); none may fail."""
    grpc = pytest.importorskip("grpc")
    from concurrent import futures

    from collectives.launch import start_ranks

    server = grpc.server(futures.ThreadPoolExecutor(2))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    codes = []
    try:
        grpc.channel_ready_future(channel).result(timeout=30)
        with open(os.devnull, "w") as sink:
            for _ in range(15):
                group, _store = start_ranks([sys.executable, "-c", "pass"], 4, {},
                                            stdout=sink, stderr=sink)
                with group:
                    codes += [p.wait(timeout=60) for p in group.procs]
    finally:
        channel.close()
        server.stop(None)
    assert codes == [0] * 60


def test_every_rank_names_the_rank_that_never_came_as_rank_0_found_it():
    store, errors = InMemoryStore(), {}

    def rank(r):
        try:
            build_mesh(store, r, 3, "h", "127.0.0.1", SECRET, "t", 1.0, force_tcp=True)
        except CollectiveTimeout as exc:
            errors[r] = str(exc)

    ts = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]  # rank 2 never comes
    t0 = time.monotonic()
    [t.start() for t in ts]
    [t.join(20) for t in ts]
    assert sorted(errors) == [0, 1], errors
    for r, text in errors.items():
        assert f"on rank {r}/3" in text and "never published its address (peer rank 2)" in text
    assert time.monotonic() - t0 < 5  # rank 0's account, within the timeout
