"""Backends: native CPU (shm + TCP), MPI (mpi4py), NCCL (CuPy)."""
