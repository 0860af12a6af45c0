"""GPU tests: run by tools/gpu_check.sh on a machine with a CUDA GPU, on 1 rank or under mpirun (several
processes may share one GPU). Without a GPU every test here is skipped, saying so.

The session fixture, the abort-on-failure hook and rank_data are tests/mpi/conftest.py's own."""

import importlib.util
import os
import sys

_MPI_TESTS = os.path.join(os.path.dirname(__file__), "..", "mpi")
sys.path.insert(0, _MPI_TESTS)  # job_env and test_staging's helpers

_spec = importlib.util.spec_from_file_location("perseus_mpi_conftest", os.path.join(_MPI_TESTS, "conftest.py"))
_mpi = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mpi)

# (test_staging, imported by these tests, takes rank_data from whichever conftest module Python finds first)
hvd, pytest_runtest_logreport, rank_data = _mpi.hvd, _mpi.pytest_runtest_logreport, _mpi.rank_data
