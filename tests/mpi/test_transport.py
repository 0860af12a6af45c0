"""The native engine's allreduce algorithms (MPI_Allreduce on a channel thread, the ring, and MPI's non-blocking
all-reduce on the engine thread's lane) against a reference, every dtype and op, through a second engine built
for the path on a duplicate of the world communicator."""

import types

import numpy as np
import pytest

from conftest import rank_data

pytestmark = [pytest.mark.timeout(120), pytest.mark.rank_count]

OPS = {"sum": 1, "min": 3, "max": 4, "product": 5}


@pytest.fixture(scope="module")
def engines(hvd):
    from mpi4py import MPI

    from perseus.runtime.state import runtime
    from perseus.engine.native import ENGINE_SETTINGS, Engine

    made = {}
    # path: (algorithm, engine_lane_bytes). "mpi" keeps every unit on a channel thread; "lane" moves every
    # unit (at most 64 KiB here) on the engine thread; "auto" has the default lane.
    paths = {"mpi": ("mpi", 0), "ring": ("ring", 0), "lane": ("mpi", 1 << 20),
             "auto": ("auto", runtime().settings.engine_lane_bytes)}
    for path, (algorithm, lane_bytes) in paths.items():
        values = {name: getattr(runtime().settings, name) for name in ENGINE_SETTINGS}
        # Small thresholds: a 70000-element tensor is reduced in place in several units.
        values.update(allreduce_algorithm=algorithm, fusion_threshold_bytes=64 << 10,
                      inplace_threshold_bytes=16 << 10, cycle_time_ms=0.0, engine_lane_bytes=lane_bytes)
        engine = Engine(types.SimpleNamespace(**values), MPI.COMM_WORLD.Get_rank())
        engine.add_process_set(0, MPI.COMM_WORLD.Dup(), list(range(MPI.COMM_WORLD.Get_size())))
        engine.start()
        made[path] = engine
    yield made
    for engine in made.values():
        engine.shutdown()


def allreduce(engine, name, src, out, op, postscale=1.0):
    from perseus.engine.messages import OpType, Request, dtype_of

    item = Request(name=name, dtype=dtype_of(out), shape=out.shape, input=src, output=out, reduce_op=op,
                   postscale=float(postscale))
    engine.wait(engine.submit(0, OpType.ALLREDUCE, [item], None, (src, out)))


@pytest.mark.parametrize("algorithm", ["mpi", "ring", "lane"])
@pytest.mark.parametrize("dtype", ["int32", "int64", "float16", "float32", "float64", "bool", "uint8"])
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("in_place", [True, False])
def test_allreduce_algorithms(hvd, engines, algorithm, dtype, op, in_place):
    size, rank = hvd.size(), hvd.rank()
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
        allreduce(engines[algorithm], f"{algorithm}.{dtype}.{op}.{in_place}.{n}", None if in_place else mine,
                  out, OPS[op])
        if not in_place:
            np.testing.assert_array_equal(mine, inputs[rank])
        np.testing.assert_allclose(out.astype(np.float64), np.asarray(ref, np.float64), rtol=1e-3)


@pytest.mark.parametrize("algorithm", ["mpi", "ring", "auto", "lane"])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32"])
def test_allreduce_postscale(hvd, engines, algorithm, dtype):
    size, rank = hvd.size(), hvd.rank()
    for n in (5, 100_000):
        inputs = [rank_data(r, (n,), dtype, seed=7) for r in range(size)]
        src = inputs[rank].copy()
        out = np.empty_like(src)
        allreduce(engines[algorithm], f"post.{dtype}.{n}", src, out, 1, 1.0 / size)
        ref = np.stack([x.astype(np.float64) for x in inputs]).sum(0) / size
        if dtype == "int32":
            ref = np.trunc(ref)
        np.testing.assert_allclose(out.astype(np.float64), ref, rtol=2e-3, atol=2e-3)
