"""Bad input across ranks: every rank raises an MXNetError naming the tensor and ranks within seconds (never
a hang), and the engine keeps working afterwards. Bad arguments are refused before anything is sent."""

import time

import mxnet as mx
import numpy as np
import pytest
from mxnet.base import MXNetError

pytestmark = pytest.mark.timeout(60)


def needs_peers(hvd):
    if hvd.size() == 1:
        pytest.skip("needs 2+ ranks")


def expect_everywhere(hvd, fn, *patterns):
    """Run ``fn`` on every rank; each must raise an MXNetError that is also a perseus MismatchError."""
    start = time.monotonic()
    with pytest.raises(MXNetError) as info:
        out = fn()
        out.wait_to_read()
    err = info.value
    assert isinstance(err, hvd.MismatchError) and isinstance(err, hvd.HorovodInternalError)
    assert isinstance(err, hvd.PerseusMXNetMismatchError)
    message = str(err)
    for p in patterns:
        assert p in message, message
    assert time.monotonic() - start < 10
    # The engine is still healthy afterwards.
    ok = hvd.allreduce(mx.nd.ones((2,)), op=hvd.Sum, name="after_error")
    assert ok.asnumpy().tolist() == [hvd.size()] * 2
    return message


def test_shape_mismatch(hvd):
    needs_peers(hvd)
    shape = (4, 3) if hvd.rank() == 0 else (4, 2)
    msg = expect_everywhere(hvd, lambda: hvd.allreduce(mx.nd.ones(shape), name="mm_shape"),
                            "allreduce.mm_shape", "shape", "(4, 3)", "(4, 2)", "[0]")
    assert "same shape" in msg


def test_inplace_and_grouped_shape_mismatch(hvd):
    needs_peers(hvd)
    n = 3 + (hvd.rank() > 0)
    expect_everywhere(hvd, lambda: hvd.allreduce_(mx.nd.ones((n,)), name="mm_inplace"), "allreduce.mm_inplace")
    expect_everywhere(hvd, lambda: hvd.grouped_allreduce([mx.nd.ones((2,)), mx.nd.ones((n,))], name="mm_group")[1],
                      "allreduce.mm_group")


def test_dtype_mismatch(hvd):
    needs_peers(hvd)
    dtype = "float32" if hvd.rank() == 0 else "int32"
    expect_everywhere(hvd, lambda: hvd.allreduce(mx.nd.ones((3,), dtype=dtype), name="mm_dtype"),
                      "allreduce.mm_dtype", "dtype", "float32", "int32")


def test_op_and_scale_mismatch(hvd):
    needs_peers(hvd)
    op = hvd.Sum if hvd.rank() == 0 else hvd.Max
    expect_everywhere(hvd, lambda: hvd.allreduce(mx.nd.ones((3,)), op=op, name="mm_op"), "op", "Sum", "Max")
    pre = 1.0 if hvd.rank() == 0 else 2.0
    expect_everywhere(hvd, lambda: hvd.allreduce(mx.nd.ones((3,)), prescale_factor=pre, name="mm_pre"),
                      "prescale_factor")


def test_broadcast_mismatches(hvd):
    needs_peers(hvd)
    root = 0 if hvd.rank() == 0 else 1
    expect_everywhere(hvd, lambda: hvd.broadcast(mx.nd.ones((3,)), root, name="mm_root"), "root_rank")
    expect_everywhere(hvd, lambda: hvd.broadcast_(mx.nd.ones((17, hvd.rank() + 1)), 0, name="mm_bshape"),
                      "broadcast.mm_bshape", "shape")


def test_allgather_alltoall_reducescatter_mismatches(hvd):
    needs_peers(hvd)
    trailing = 3 if hvd.rank() == 0 else 4
    expect_everywhere(hvd, lambda: hvd.allgather(mx.nd.ones((2, trailing)), name="mm_ag"),
                      "allgather.mm_ag", "shape after the first dimension")
    dtype = "float32" if hvd.rank() == 0 else "int32"
    expect_everywhere(hvd, lambda: hvd.alltoall(mx.nd.ones((hvd.size(),), dtype=dtype), name="mm_a2a"),
                      "alltoall.mm_a2a", "dtype")
    rows = 2 * hvd.size() + (hvd.rank() > 0)
    expect_everywhere(hvd, lambda: hvd.reducescatter(mx.nd.ones((rows, 2)), name="mm_rs"),
                      "reducescatter.mm_rs", "shape")


def test_mismatch_inside_trainer(hvd):
    """A model whose shapes differ between ranks fails in DistributedTrainer.step on every rank."""
    needs_peers(hvd)
    net = mx.gluon.nn.Dense(2 + (hvd.rank() > 0), in_units=3)
    net.initialize()
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, prefix="mm_trainer.")
    with mx.autograd.record():
        loss = net(mx.nd.ones((4, 3))).sum()
    loss.backward()
    with pytest.raises(MXNetError, match="mm_trainer"):
        trainer.step(4)
    ok = hvd.allreduce(mx.nd.ones((2,)), op=hvd.Sum, name="after_trainer_error")
    assert ok.asnumpy().tolist() == [hvd.size()] * 2


def test_argument_errors_are_local(hvd):
    """Refused on the calling rank before anything is sent: every rank makes them, no peer waits."""
    size = hvd.size()
    with pytest.raises(ValueError, match="scalar") as info:
        hvd.reducescatter(mx.nd.array(1.0), op=hvd.Average)
    assert isinstance(info.value, MXNetError)
    with pytest.raises(ValueError, match="scalar"):
        hvd.grouped_reducescatter([mx.nd.ones((2,)), mx.nd.array(1.0)])
    if size > 1:
        with pytest.raises(MXNetError, match="divisible"):
            hvd.alltoall(mx.nd.ones((size + 1,)))
        with pytest.raises(MXNetError, match="sum to the first dimension"):
            hvd.alltoall(mx.nd.ones((size - 1,)), mx.nd.ones((size,), dtype="int32"))
    with pytest.raises(ValueError, match="integers"):
        hvd.alltoall(mx.nd.ones((size,)), mx.nd.ones((size,), dtype="float32"))
    with pytest.raises(MXNetError, match="one count per rank"):
        hvd.alltoall(mx.nd.ones((size,)), [1] * (size + 1))
    with pytest.raises(ValueError, match="root_rank"):
        hvd.broadcast(mx.nd.ones((2,)), root_rank=size)
    with pytest.raises(ValueError, match="Adasum needs floating-point"):
        hvd.allreduce(mx.nd.ones((2,), dtype="int32"), op=hvd.Adasum)
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.reducescatter(mx.nd.ones((2,)), op=hvd.Adasum)
    with pytest.raises(TypeError, match="NDArray"):
        hvd.allreduce(np.ones(2))
    with pytest.raises(TypeError, match="list"):
        hvd.grouped_allreduce(mx.nd.ones((2,)))
    with pytest.raises(ValueError, match="row_sparse"):
        hvd.allreduce(mx.nd.ones((2, 2)).tostype("row_sparse"))
    with pytest.raises(ValueError, match="invalid params"):
        hvd.broadcast_parameters([mx.nd.ones((2,))])
    # Nothing was left behind: the next collective runs normally.
    ok = hvd.allreduce(mx.nd.ones((2,)), op=hvd.Sum, name="after_local_errors")
    assert ok.asnumpy().tolist() == [size] * 2

