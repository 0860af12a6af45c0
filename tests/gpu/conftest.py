"""GPU tests: run by tools/gpu_check.sh on a machine with a CUDA GPU, on 1 rank or under mpirun (several
processes may share one GPU). Without a GPU every test here is skipped, saying so."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "mpi"))  # rank_data, shared with tests/mpi


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
