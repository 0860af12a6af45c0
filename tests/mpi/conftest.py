"""Tests under mpirun: every rank runs the same tests in the same order.

A failing test on any rank prints its report and aborts the whole MPI job, so the other ranks cannot hang
waiting for a collective the failed rank will never make.
"""

import os
import sys

import numpy as np
import pytest

os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
os.environ.setdefault("PERSEUS_STALL_SHUTDOWN_TIME_SECONDS", "30")


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
            sys.stderr.write("aborting the MPI job so the other ranks do not hang\n")
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(1)


def rank_data(rank: int, shape, dtype: str, seed: int = 0) -> np.ndarray:
    """Deterministic small integers (exact in every dtype, sums too) for ``rank``; any rank can rebuild
    any other rank's input, so references are computed locally from all ranks' inputs."""
    rng = np.random.default_rng(seed * 7919 + rank)
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    lo, hi = (0, 8) if dtype.startswith("uint") else (-8, 8)
    return rng.integers(lo, hi, size=shape).astype(dtype if dtype != "bfloat16" else "float32")
