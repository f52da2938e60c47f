"""Horovod scripts run under mpiexec unchanged: `import horovod_spark.torch as hvd`."""
from __future__ import annotations

import os

import pytest

from _mpi_support import HERE, mpiexec, python, requires_mpi

TRAIN = os.path.join(HERE, "_mpi_train.py")


@pytest.mark.mpi
@pytest.mark.slow
@requires_mpi
@pytest.mark.timeout(240)
def test_distributed_optimizer_under_mpiexec_matches_one_full_batch_process():
    proc = mpiexec(2, [TRAIN, "6"], timeout=200)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert proc.stdout.count("MPI TRAIN OK") == 2, proc.stdout[-6000:]


@pytest.mark.mpi
@pytest.mark.slow
@requires_mpi
@pytest.mark.timeout(240)
def test_horovod_spark_run_mpi_launches_the_script_on_np_ranks():
    # The CLI itself runs without MPI; it hands the script to mpiexec.
    proc = python("import sys; from horovod_spark.cli import main; "
                  f"sys.exit(main(['run', '--mpi', '--np', '3', {TRAIN!r}, '3']))", timeout=200)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.stdout.count("MPI TRAIN OK") == 3, proc.stdout[-6000:]


@pytest.mark.mpi
@requires_mpi
@pytest.mark.timeout(240)
def test_process_sets_run_under_mpiexec_from_ranks_and_from_an_mpi4py_communicator():
    proc = mpiexec(3, [os.path.join(HERE, "_mpi_psets.py")], timeout=200)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert proc.stdout.count("MPI PSETS OK") == 3, proc.stdout[-6000:]
