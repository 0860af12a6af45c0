"""perseus.mxnet tests under mpirun (run from .venv-mxnet): every rank runs the same tests in the same order.

A failing test on any rank prints its report and aborts the whole MPI job, so the other ranks cannot hang
waiting for a collective the failed rank will never make. Every test has a timeout (120 s unless the test
module says otherwise).
"""

import os
import sys

import pytest

os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
os.environ.setdefault("PERSEUS_STALL_SHUTDOWN_TIME_SECONDS", "30")

DEFAULT_TIMEOUT_S = 120


@pytest.fixture(scope="session", autouse=True)
def hvd():
    import perseus.mxnet as hvd

    hvd.init()
    yield hvd
    hvd.shutdown()


def pytest_configure(config):
    # MXNet 1.9 itself triggers NumPy/SciPy deprecation warnings at import and in mx.nd.array.
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning:mxnet")


def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(DEFAULT_TIMEOUT_S))


def pytest_runtest_logreport(report):
    if report.failed:
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_size() > 1:
            sys.stderr.write(f"\n[rank {MPI.COMM_WORLD.Get_rank()}] FAILED {report.nodeid}\n{report.longrepr}\n")
            sys.stderr.write("aborting the MPI job so the other ranks do not hang\n")
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(1)

