"""GPU tests: run by tools/gpu_check.sh on a machine with a CUDA GPU, on 1 rank or under mpirun (several
processes may share one GPU). Without a GPU every test here is skipped, saying so."""

import os
import sys

import pytest

_MPI_TESTS = os.path.join(os.path.dirname(__file__), "..", "mpi")
sys.path.insert(0, _MPI_TESTS)  # job_env and test_staging's helpers


def _mpi_conftest():
    import importlib.util

    spec = importlib.util.spec_from_file_location("perseus_mpi_conftest", os.path.join(_MPI_TESTS, "conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# test_staging (imported by these tests) takes rank_data from whichever conftest module Python finds first.
rank_data = _mpi_conftest().rank_data


@pytest.fixture(scope="session", autouse=True)
def hvd():
    import perseus.torch as hvd

    hvd.init()
    yield hvd
    hvd.shutdown()


def pytest_runtest_logreport(report):
    if report.failed:
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_size() > 1:
            sys.stderr.write(f"\n[rank {MPI.COMM_WORLD.Get_rank()}] FAILED {report.nodeid}\n{report.longrepr}\n")
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(1)
