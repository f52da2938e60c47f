"""torch.distributed's "hvs" backend: the package's transport under torch's c10d API.

Every op and dtype gives Gloo's answer on the same inputs (2, 3 and 4 ranks); DDP and FSDP2
end with Gloo's weights; `init_process_group("hvs")` needs no import inside a job and works
under torchrun and a bare env:// launcher after `import horovod_spark.torch`; a mismatched
collective and a dead peer raise named errors on every surviving rank, fast; destroying the
group leaves no thread, socket or segment.  The emulated hosts run it in
tests/cluster/test_cluster_collectives.py.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import cloudpickle
import numpy as np
import pytest

import _hvs_checks as checks
import horovod_spark

pytest.importorskip("torch")
cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
HERE = Path(__file__).parent


def _local(fn, np_, *args):
    return horovod_spark.run(fn, args=args, num_proc=-np_, verbose=0)


@pytest.mark.parametrize("np_", [2, 3, 4])
def test_every_op_and_dtype_gives_gloos_answer(np_):
    for rank, disagreements in enumerate(_local(checks.agree_with_gloo, np_)):
        assert disagreements == [], f"rank {rank}"


def test_subgroups_of_new_group_reduce_their_own_ranks():
    assert _local(checks.subgroups, 3) == [True] * 3


def _assert_same_weights(hvs: dict, gloo: dict) -> None:
    assert set(hvs) == set(gloo)
    for name in gloo:
        np.testing.assert_allclose(hvs[name], gloo[name], rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_ddp_and_fsdp2_end_with_gloos_weights(kind):
    gloo = _local(checks.train, 3, "gloo", kind)
    hvs = _local(checks.train, 3, "hvs", kind)
    for rank in range(3):
        _assert_same_weights(hvs[rank], gloo[rank])


@pytest.mark.spark
def test_ddp_over_hvs_on_spark_tasks_ends_with_gloos_weights(spark):
    from horovod_spark import TorchDistributor

    run = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, verbose=0).run
    _assert_same_weights(run(checks.train, "hvs", "ddp"), run(checks.train, "gloo", "ddp"))


def test_an_async_works_future_chains_as_ddps_comm_hooks_do():
    assert _local(checks.async_work_chains_a_future, 2) == [[30.0] * 4] * 2


def test_an_op_it_has_not_is_refused_naming_what_to_do():
    for said in _local(checks.unsupported, 2):
        assert said.startswith("NotSupported: hvs recv: a receive from any source; name the "
                               "source rank"), said


def test_a_mismatched_collective_raises_on_every_rank():
    said = _local(checks.mismatch, 2)
    assert said[0].startswith("MismatchError: allreduce #1 on rank 0/2: ranks disagree"), said
    assert said[1].startswith("MismatchError: allreduce #1 on rank 1/2: ranks disagree"), said
    assert "sum of 4 float32" in said[0] and "sum of 8 float32" in said[0]


def test_a_killed_rank_is_the_one_the_job_names():
    with pytest.raises(horovod_spark.JobFailedError, match=r"on rank 1/3: ProcessDied"):
        _local(checks.one_rank_dies, 3)


def test_destroying_the_group_leaves_no_thread_socket_or_segment():
    for before, after in _local(checks.leaves_nothing, 2):
        assert after == before


# -- outside the package's jobs: torchrun and a bare env:// launcher ---------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HVS_", "MASTER_", "RANK",
                                                                   "WORLD_SIZE", "LOCAL_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    return env


def _results(out: Path, n: int) -> list:
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(n)]


def test_under_torchrun_ddp_and_fsdp2_end_with_gloos_weights(tmp_path):
    torchrun = shutil.which("torchrun") or pytest.skip("torchrun is not on PATH")
    got = {}
    for backend in ("gloo", "hvs"):
        for kind in ("ddp", "fsdp2"):
            out = tmp_path / f"{backend}-{kind}"
            done = subprocess.run(
                [torchrun, "--standalone", "--nproc-per-node=2", str(HERE / "_hvs_checks.py"),
                 "train", backend, kind, str(out)],
                env=_env(), capture_output=True, text=True, timeout=240)
            assert done.returncode == 0, done.stderr[-3000:]
            got[backend, kind] = _results(out, 2)
    for kind in ("ddp", "fsdp2"):
        for rank in range(2):
            _assert_same_weights(got["hvs", kind][rank], got["gloo", kind][rank])


def _env_launch(check: str, n: int, out: Path) -> list:
    """`n` processes of `_hvs_checks.py check` with env://'s variables set by hand."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(HERE / "_hvs_checks.py"), check, str(out)],
                              env=dict(_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                       RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for r in range(n)]
    try:
        for p in procs:
            p.wait(timeout=60)  # the bound that fails the test: no rank waits out a timeout
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return procs


def test_under_an_env_launcher_a_killed_peer_is_named_on_every_survivor_fast(tmp_path):
    out = tmp_path / "dies"
    procs = _env_launch("one_rank_dies", 3, out)
    assert procs[1].returncode == -9
    for rank in (0, 2):
        assert procs[rank].returncode == 0, procs[rank].stderr.read()[-3000:]
        said = json.loads(Path(f"{out}.{rank}").read_text())
        assert said.startswith("PeerLostError") and "rank 1" in said, said


def test_under_an_env_launcher_an_async_all_reduce_chains_its_future(tmp_path):
    out = tmp_path / "chain"
    procs = _env_launch("async_work_chains_a_future", 2, out)
    assert [p.returncode for p in procs] == [0, 0], procs[0].stderr.read()[-3000:]
    assert _results(out, 2) == [[30.0] * 4] * 2
