"""Bad input across ranks: every rank raises a clear error within seconds, and the engine keeps working."""

import time

import pytest
import torch

pytestmark = [pytest.mark.timeout(60), pytest.mark.rank_count]


def expect_everywhere(hvd, fn, *patterns):
    """Run ``fn`` on every rank; each must raise HorovodInternalError (a RuntimeError) matching patterns."""
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        fn()
    assert isinstance(info.value, hvd.HorovodInternalError)
    message = str(info.value)
    for p in patterns:
        assert p in message, message
    assert time.monotonic() - start < 10
    # The engine is still healthy afterwards.
    out = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after_error")
    assert out.tolist() == [hvd.size()] * 2
    return message


def test_shape_mismatch(hvd):
    if hvd.size() == 1:
        pytest.skip("needs 2+ ranks")
    shape = (4, 3) if hvd.rank() == 0 else (4, 2)
    msg = expect_everywhere(hvd, lambda: hvd.allreduce(torch.ones(shape), name="mismatch_shape"),
                            "allreduce.mismatch_shape", "shape", "(4, 3)", "(4, 2)", "[0]")
    assert "same shape" in msg


def test_dtype_mismatch(hvd):
    if hvd.size() == 1:
        pytest.skip("needs 2+ ranks")
    dt = torch.float32 if hvd.rank() == 0 else torch.int32
    expect_everywhere(hvd, lambda: hvd.allreduce(torch.ones(3, dtype=dt), name="mismatch_dtype"),
                      "dtype", "float32", "int32")


def test_op_mismatch(hvd):
    if hvd.size() == 1:
        pytest.skip("needs 2+ ranks")
    op = hvd.Sum if hvd.rank() == 0 else hvd.Max
    expect_everywhere(hvd, lambda: hvd.allreduce(torch.ones(3), op=op, name="mismatch_op"), "op", "Sum", "Max")


def test_scale_mismatch(hvd):
    if hvd.size() == 1:
        pytest.skip("needs 2+ ranks")
    pre = 1.0 if hvd.rank() == 0 else 2.0
    expect_everywhere(hvd, lambda: hvd.allreduce(torch.ones(3), prescale_factor=pre, name="mismatch_pre"),
                      "prescale_factor")


def test_root_mismatch(hvd):
    if hvd.size() == 1:
        pytest.skip("needs 2+ ranks")
    root = 0 if hvd.rank() == 0 else 1
    expect_everywhere(hvd, lambda: hvd.broadcast(torch.ones(3), root, name="mismatch_root"), "root_rank")


def test_allgather_trailing_shape_mismatch(hvd):
    if hvd.size() == 1:
        pytest.skip("needs 2+ ranks")
    trailing = (3,) if hvd.rank() == 0 else (4,)
    expect_everywhere(hvd, lambda: hvd.allgather(torch.ones((2,) + trailing), name="trailing"),
                      "allgather.trailing", "shape after the first dimension")


def test_allgather_first_dim_may_differ(hvd):
    out = hvd.allgather(torch.ones(hvd.rank() + 1, 2), name="first_dim_ok")
    assert out.shape == (sum(range(1, hvd.size() + 1)), 2)


def test_duplicate_name_in_flight(hvd):
    # Each rank first submits a name of its own, which no other rank submits before an MPI barrier: the
    # request is certainly still in flight when the same name comes again, however fast the machine is.
    from mpi4py import MPI

    mine = f"dup.{hvd.rank()}"
    handles = {mine: hvd.allreduce_async(torch.ones(2), name=mine)}
    with pytest.raises(ValueError, match="already in flight"):
        hvd.allreduce_async(torch.ones(2), name=mine)
    MPI.COMM_WORLD.Barrier()
    for name in (f"dup.{r}" for r in range(hvd.size())):
        if name not in handles:
            handles[name] = hvd.allreduce_async(torch.ones(2), name=name)
    for name in sorted(handles):
        hvd.synchronize(handles[name])
    hvd.synchronize(hvd.allreduce_async(torch.ones(2), name="dup.0"))  # fine once the first is done


def test_bad_arguments_fail_on_caller_thread(hvd):
    with pytest.raises(ValueError, match="not supported"):
        hvd.allreduce(torch.ones(2, dtype=torch.complex64), name="complex")
    with pytest.raises(ValueError, match="contiguous"):
        hvd.allreduce_(torch.ones(4, 4).t(), name="noncontig")
    with pytest.raises(ValueError, match="op parameter supersedes"):
        hvd.allreduce(torch.ones(2), average=True, op=hvd.Sum)
    with pytest.raises(TypeError):
        hvd.allreduce([1, 2, 3], name="list")
