"""The MPI transport's allreduce algorithms (native and ring) against a reference, every dtype and op."""

import numpy as np
import pytest

from conftest import rank_data

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def comm(hvd):
    from mpi4py import MPI

    from perseus.transport.mpi import MpiComm

    c = MpiComm(MPI.COMM_WORLD.Dup())
    yield c
    c.comm.Free()


OPS = {"sum": 1, "min": 3, "max": 4, "product": 5}


@pytest.mark.parametrize("algorithm", ["mpi", "ring"])
@pytest.mark.parametrize("dtype", ["int32", "int64", "float16", "float32", "float64", "bool", "uint8"])
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("in_place", [True, False])
def test_allreduce_algorithms(comm, algorithm, dtype, op, in_place):
    from perseus.engine.messages import dtype_of

    size, rank = comm.size, comm.rank
    for n in (0, 1, size - 1, 1001, 70000):
        inputs = [rank_data(r, (n,), dtype, seed=n) for r in range(size)]
        if op == "product" and dtype != "bool":
            inputs = [np.clip(x, 0 if dtype == "uint8" else -2, 2).astype(dtype) for x in inputs]
        stack = np.stack([x.astype(np.float64) if dtype != "bool" else x for x in inputs])
        ref = {"sum": stack.any(0) if dtype == "bool" else stack.sum(0),
               "min": stack.all(0) if dtype == "bool" else stack.min(0),
               "max": stack.any(0) if dtype == "bool" else stack.max(0),
               "product": stack.all(0) if dtype == "bool" else stack.prod(0)}[op]
        mine = inputs[rank].copy()
        out = mine if in_place else np.empty_like(mine)
        comm.allreduce(None if in_place else mine, out, dtype_of(mine), OPS[op], 1.0, algorithm)
        if not in_place:
            np.testing.assert_array_equal(mine, inputs[rank])
        np.testing.assert_allclose(out.astype(np.float64), np.asarray(ref, np.float64), rtol=1e-3)


@pytest.mark.parametrize("algorithm", ["mpi", "ring", "auto"])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32"])
def test_allreduce_postscale(comm, algorithm, dtype):
    from perseus.engine.messages import dtype_of

    size, rank = comm.size, comm.rank
    for n in (5, 100_000):
        inputs = [rank_data(r, (n,), dtype, seed=7) for r in range(size)]
        src = inputs[rank].copy()
        out = np.empty_like(src)
        comm.allreduce(src, out, dtype_of(src), 1, 1.0 / size, algorithm)
        ref = np.stack([x.astype(np.float64) for x in inputs]).sum(0) / size
        if dtype == "int32":
            ref = np.trunc(ref)
        np.testing.assert_allclose(out.astype(np.float64), ref, rtol=2e-3, atol=2e-3)
