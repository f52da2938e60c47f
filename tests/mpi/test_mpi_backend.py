"""The MPI backend, run for real under mpiexec, and its behaviour without MPI."""
from __future__ import annotations

import os

import pytest

from _mpi_support import HERE, REPO, mpiexec, python, requires_mpi

WORLD = os.path.join(HERE, "_mpi_world.py")
HAS_SUITE = os.path.exists(os.path.join(REPO, "tests", "collectives", "suite.py"))
_runs: dict = {}


def _world(n: int):
    """One mpiexec launch per world size runs every check; the tests read its output."""
    if n not in _runs:
        argv = [WORLD] + (["--front-end"] + (["--suite"] if HAS_SUITE else []) if n > 1 else [])
        _runs[n] = mpiexec(n, argv, timeout=280)
    return _runs[n]


def _assert_part(n: int, marker: str) -> None:
    proc = _world(n)
    assert proc.stdout.count(marker) == n, proc.stdout[-8000:]  # one line per rank


@pytest.mark.mpi
@requires_mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_every_op_dtype_and_count_matches_numpy_under_mpiexec(n):
    _assert_part(n, "MPI CHECKS OK")


@pytest.mark.mpi
@requires_mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 3])
def test_init_under_mpiexec_picks_the_mpi_backend_with_placement_from_mpi(n):
    _assert_part(n, "MPI INIT OK")


@pytest.mark.mpi
@requires_mpi
@pytest.mark.timeout(300)
@pytest.mark.skipif(not HAS_SUITE, reason="the shared suite tests/collectives/suite.py is not written yet")
@pytest.mark.parametrize("n", [2, 3])
def test_the_shared_collective_suite_passes_under_mpiexec(n):
    _assert_part(n, "MPI SUITE OK")
    assert _world(n).returncode == 0, _world(n).stdout[-8000:]


@pytest.mark.mpi
@requires_mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 3])
def test_nccls_unique_id_travels_over_mpi_when_there_is_no_store(n):
    _assert_part(n, "MPI NCCL BOOT OK")


@pytest.mark.mpi
@requires_mpi
def test_launched_by_mpiexec_is_true_inside_mpiexec_and_false_outside():
    code = ("import os, sys; from collectives.backends.mpi import launched_by_mpiexec as l; "
            "os.write(1, f'LAUNCHED {l(os.environ)}\\n'.encode())")  # one write: ranks' lines never interleave
    inside = mpiexec(2, ["-c", code], timeout=60)
    assert inside.returncode == 0, inside.stdout
    assert inside.stdout.count("LAUNCHED True") == 2, inside.stdout
    outside = python(code)
    assert "LAUNCHED False" in outside.stdout, outside.stdout + outside.stderr


@pytest.mark.parametrize("env", [
    {"PMI_RANK": "0"}, {"PMIX_RANK": "3"}, {"OMPI_COMM_WORLD_RANK": "1"},
    {"MPI_LOCALRANKID": "0"}, {"MV2_COMM_WORLD_RANK": "2"},
])
def test_each_launchers_rank_variable_is_recognised(env):
    from collectives.backends.mpi import launched_by_mpiexec
    assert launched_by_mpiexec(env)


def test_a_plain_or_slurm_environment_is_not_an_mpi_launch():
    from collectives.backends.mpi import launched_by_mpiexec
    assert not launched_by_mpiexec({})
    assert not launched_by_mpiexec({"SLURM_PROCID": "0", "PMI_RANK": ""})


_HIDE_MPI4PY = "import sys; sys.modules['mpi4py'] = None; sys.modules['mpi4py.MPI'] = None; "


def test_import_collectives_works_without_mpi4py():
    proc = python(_HIDE_MPI4PY + "import collectives, collectives.backends.mpi; print('IMPORTED')")
    assert "IMPORTED" in proc.stdout, proc.stderr


def test_missing_mpi4py_is_reported_with_an_install_hint():
    proc = python(_HIDE_MPI4PY + """
from collectives.backends.mpi import MpiBackend, available
from collectives.errors import NotSupported
ok, reason = available()
print('AVAILABLE', ok, reason)
try:
    MpiBackend.from_world()
except NotSupported as exc:
    print('RAISED', exc)
""")
    assert "AVAILABLE False" in proc.stdout, proc.stdout + proc.stderr
    assert "RAISED backend mpi is not available: mpi4py is not installed" in proc.stdout, proc.stdout
    assert "pip install mpi4py mpich" in proc.stdout


@requires_mpi
def test_missing_mpi_runtime_is_reported_with_an_install_hint():
    # mpi4py is present, but the MPI library it loads is not.
    proc = python("""
from collectives.backends.mpi import MpiBackend, available
from collectives.errors import NotSupported
print('AVAILABLE', *available())
try:
    MpiBackend.from_world()
except NotSupported as exc:
    print('RAISED', exc)
""", env={"MPI4PY_LIBMPI": os.path.join(REPO, "no-such-libmpi.so.12")})
    assert "AVAILABLE False" in proc.stdout, proc.stdout + proc.stderr
    assert "cannot load an MPI runtime" in proc.stdout and "no-such-libmpi" in proc.stdout, proc.stdout
    assert "pip install mpi4py mpich" in proc.stdout



@pytest.mark.mpi
@requires_mpi
def test_a_rank_that_dies_mid_job_ends_every_rank_with_a_failure_not_a_hang():
    code = ("import os, numpy as np; from collectives.backends.mpi import MpiBackend; "
            "from collectives.types import DType, ReduceOp; b = MpiBackend.from_world(); "
            "x = np.ones(8, np.float32); b.allreduce(x, x, DType.FLOAT32, ReduceOp.SUM); "
            "b.rank == 1 and os._exit(7); b.allreduce(x, x, DType.FLOAT32, ReduceOp.SUM); "
            "print('SURVIVOR RETURNED', flush=True)")
    proc = mpiexec(3, ["-c", code], timeout=60)  # mpiexec kills the others; the timeout bounds it
    # mpiexec reports the first bad termination it sees: rank 1's 7, or a survivor it killed (9).
    assert proc.returncode in (7, 9), proc.stdout[-3000:]
    assert "SURVIVOR RETURNED" not in proc.stdout
