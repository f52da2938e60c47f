"""torchrun's environment in every rank of every job, so torch.distributed code runs as it is.

A DDP script that calls `init_process_group("gloo")` (env://) runs unchanged under
`horovod-spark run`, on Spark and on a Spark Connect server, and ends with the weights one
process reaches on every rank's data; every launcher sets the same variables from the
job's placement.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import cloudpickle
import pytest

import _torchdist_programs as programs
import horovod_spark

pytest.importorskip("torch")
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the executors cannot import it
pytestmark = [pytest.mark.timeout(300)]

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ddp_script.py")


def _facts():
    return {**programs.torchrun_env(), "HVS_BIND_ADDR": os.environ["HVS_BIND_ADDR"]}


def _same_job(envs, size):
    assert [e["RANK"] for e in envs] == [str(r) for r in range(size)]
    assert {e["WORLD_SIZE"] for e in envs} == {str(size)}
    assert len({e["MASTER_PORT"] for e in envs}) == 1 and int(envs[0]["MASTER_PORT"]) > 0
    assert len({e["TORCHELASTIC_RUN_ID"] for e in envs}) == 1
    assert {e["TORCHELASTIC_RESTART_COUNT"] for e in envs} == {"0"}
    assert [e["ROLE_RANK"] for e in envs] == [e["RANK"] for e in envs]


def test_local_ranks_are_one_node_of_torchrun():
    envs = horovod_spark.run(programs.torchrun_env, num_proc=-3, verbose=0)
    _same_job(envs, 3)
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2"]
    assert {(e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"], e["NODE_RANK"], e["GROUP_WORLD_SIZE"])
            for e in envs} == {("3", "0", "0", "1")}
    assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"}


@pytest.mark.spark
def test_spark_ranks_meet_at_rank_0s_task_address(spark):
    envs = horovod_spark.run(programs.torchrun_env, num_proc=2, verbose=0)
    _same_job(envs, 2)
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"]  # one host: a node of two
    addrs = horovod_spark.run(_facts, num_proc=2, verbose=0)
    assert {e["MASTER_ADDR"] for e in addrs} == {addrs[0]["HVS_BIND_ADDR"]}


@pytest.mark.spark
def test_the_master_port_is_free_for_torch_and_taken_for_everyone_else(spark):
    def bind_it():
        import errno
        import os
        import socket

        import torch.distributed as dist
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        taken = []
        # torch's TCPStore listens on every address, so the port must be held on every
        # address: one bound on the task's address only was also handed to connections on
        # loopback (an outgoing connection's local port), and the store then failed with
        # EADDRINUSE.
        for where in (addr, "127.0.0.1", "0.0.0.0"):
            other = socket.socket()
            try:
                other.bind((where, port))
                taken.append(False)
            except OSError as exc:
                taken.append(exc.errno == errno.EADDRINUSE)
            finally:
                other.close()
        dist.init_process_group("gloo")  # rank 0's TCPStore binds that very port
        dist.barrier()
        dist.destroy_process_group()
        return taken

    assert horovod_spark.run(bind_it, num_proc=2, verbose=0) == [[True] * 3] * 2


def _run_cli(args, tmp_path, env=None):
    out = tmp_path / "weights.json"
    proc = subprocess.run([sys.executable, "-m", "horovod_spark.cli", "run", *args, "--verbose",
                           "0", "python", SCRIPT, str(out)], capture_output=True, text=True,
                          timeout=240, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def _assert_ddp_weights(got, world):
    import numpy as np

    expected = programs.expected_ddp_weights(world)
    assert got["world"] == world
    for name, values in expected.items():
        np.testing.assert_allclose(got["weights"][name], values, rtol=1e-5, atol=1e-6)


@pytest.mark.spark
@pytest.mark.slow
def test_a_ddp_script_runs_unchanged_under_horovod_spark_run(tmp_path):
    _assert_ddp_weights(_run_cli(["--np", "2"], tmp_path), 2)


def test_a_ddp_script_runs_unchanged_on_local_ranks(tmp_path):
    _assert_ddp_weights(_run_cli(["--np", "-3"], tmp_path), 3)


@pytest.mark.spark
@pytest.mark.slow
def test_a_ddp_script_runs_unchanged_on_a_spark_connect_server(connect_server, tmp_path):
    from connect_server import REPO

    env = {k: v for k, v in os.environ.items()
           if k not in ("SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED")}
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    got = _run_cli(["--np", "2", "--remote", connect_server.url], tmp_path, env)
    _assert_ddp_weights(got, 2)


def test_a_reserved_port_is_one_a_framework_s_listener_can_take_and_nobody_else_s():
    """MASTER_PORT and the TF ports: the reservation leaves the port to one listener that
    binds every address (torch's TCPStore, TensorFlow's gRPC server), and to no second."""
    import socket

    from collectives.launch import torchrun

    held = torchrun.reserve_port("127.0.0.1")
    port = held.getsockname()[1]
    listeners = [socket.socket() for _ in range(2)]
    try:
        for s in listeners:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listeners[0].bind(("0.0.0.0", port))
        listeners[0].listen(1)
        with pytest.raises(OSError):
            listeners[1].bind(("0.0.0.0", port))
            listeners[1].listen(1)
    finally:
        for s in listeners:
            s.close()
        held.close()
