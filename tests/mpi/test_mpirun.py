"""`horovod-spark run --mpi` underneath: run_mpi starts real ranks with mpiexec."""
from __future__ import annotations

import textwrap

import pytest

from _mpi_support import clean_env, requires_mpi

from collectives.backends.shm_names import mpi_segments
from horovod_spark._job.mpirun import mpiexec_command, run_mpi

SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import collectives
    comm = collectives.init()
    total = comm.allreduce(np.array([comm.rank + 1.0]))
    with open(sys.argv[1] + f".{comm.rank}", "w") as f:
        f.write(f"{comm.backend_name} {comm.rank} {comm.size} {total[0]:g} {' '.join(sys.argv[2:])}")
    comm.close()
    sys.exit(int(sys.argv[2]) if comm.rank == 1 and sys.argv[2:] and sys.argv[2].isdigit() else 0)
""")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.mpi
@requires_mpi
def test_run_mpi_starts_np_ranks_that_take_their_placement_from_mpi(script, tmp_path):
    out = tmp_path / "out"
    env = clean_env({"HVS_RANK": "7"})  # a leftover from an enclosing launch must not leak
    rc = run_mpi(3, str(script), [str(out), "--epochs", "2"], env=env, timeout=120)
    assert rc == 0
    lines = sorted((tmp_path / f"out.{r}").read_text() for r in range(3))
    assert lines == [f"mpi {r} 3 6 --epochs 2" for r in range(3)]


@pytest.mark.mpi
@requires_mpi
def test_run_mpi_returns_the_failing_ranks_exit_status_as_a_failure(script, tmp_path):
    rc = run_mpi(2, str(script), [str(tmp_path / "out"), "3"], env=clean_env(), timeout=120)
    assert rc != 0


DIES_MID_JOB = textwrap.dedent("""
    import os
    import numpy as np
    import collectives
    comm = collectives.init()
    x = comm.allreduce(np.ones(1 << 16, np.float32))
    if comm.rank == 1:
        os._exit(7)
    comm.allreduce(x)
""")


@pytest.mark.mpi
@requires_mpi
def test_a_rank_dying_mid_job_leaves_no_mpi_segment_in_dev_shm(tmp_path):
    """mpiexec SIGKILLs the survivors, which cannot unlink the runtime's shared memory."""
    script = tmp_path / "dies.py"
    script.write_text(DIES_MID_JOB)
    before = mpi_segments()
    rc = run_mpi(3, str(script), env=clean_env(), timeout=120)
    assert rc != 0
    assert mpi_segments() - before == set()


def test_a_missing_mpiexec_is_reported_with_an_install_hint(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="mpiexec is not on PATH; pip install mpi4py mpich"):
        mpiexec_command(2, "train.py")


def test_np_below_one_is_refused_at_the_call():
    with pytest.raises(ValueError, match="--np must be >= 1, got 0"):
        mpiexec_command(0, "train.py", mpiexec="mpiexec")
