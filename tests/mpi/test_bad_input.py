"""Bad input to every public collective of perseus.torch, as a table: each row is a call, which ranks pass the
odd value, and what every rank must see (an exception of a given type whose message holds given words, or a
result). Every row must be answered within seconds on every rank, and the job must go on afterwards.

``who``: ALL, every rank passes the odd value; ODD, only rank 1 does (the others pass the ordinary value).
``scope`` of an expected error: EVERY, every rank raises it (an argument checked the same way on every rank,
or a disagreement found by negotiation); ODD_ONLY, only the ranks that passed the odd value raise it, at once,
before anything is sent (an argument checked locally). In a real job such a rank's exception ends the job
(tests/integration/test_failures.py, "uncaught"); here the rank catches it and makes the call again with the
ordinary value, so that the other ranks' request completes and the table goes on.

Disagreements that can only end in a stall (a name or a collective that differs between ranks, grouped calls
with a different number of tensors, a call that some rank never makes) end the job by design and are covered
by the subprocess tests of tests/integration/test_bad_input_stalls.py and test_failures.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.timeout(300), pytest.mark.rank_count]

ALL, ODD = "all", "rank 1"
EVERY, ODD_ONLY = "every rank", "odd rank only"
LIMIT_S = 10.0


@dataclass
class Raises:
    exc: type
    words: tuple
    scope: str = EVERY


@dataclass
class Case:
    id: str
    call: Callable  # call(hvd, odd: bool, name: str, sets) -> result
    who: str
    expect: Optional[Raises]  # None: works
    check: Optional[Callable] = None  # check(hvd, result) for cases that work
    recover: bool = True  # ODD_ONLY: the odd rank then makes the ordinary call (False: nobody waits for it)


def raises(exc, *words, scope=EVERY):
    return Raises(exc, words, scope)


def ones(*shape, dtype=torch.float32):
    return torch.ones(shape, dtype=dtype)


def mismatch(*words):
    from perseus.base.exceptions import HorovodInternalError

    return raises(HorovodInternalError, *words)


def _sum_of_ones(hvd, out):
    assert torch.equal(out, torch.full_like(out, hvd.size())), out


# -- allreduce family -------------------------------------------------------------------------------------
ALLREDUCE = [
    Case("allreduce.complex", lambda h, o, n, s: h.allreduce(ones(2, dtype=torch.complex64 if o else torch.float32),
                                                             name=n), ALL,
         raises(ValueError, "ComplexFloatTensor", "not supported", "float32")),
    Case("allreduce.complex_one_rank",
         lambda h, o, n, s: h.allreduce(ones(2, dtype=torch.complex64 if o else torch.float32), name=n), ODD,
         raises(ValueError, "ComplexFloatTensor", "not supported", scope=ODD_ONLY)),
    Case("allreduce.dtype_differs", lambda h, o, n, s: h.allreduce(ones(3, dtype=torch.int32 if o else
                                                                        torch.float32), op=h.Sum, name=n), ODD,
         mismatch("allreduce.allreduce.dtype_differs", "dtype", "float32", "int32", "ranks [1]")),
    Case("allreduce.shape_differs", lambda h, o, n, s: h.allreduce(ones(4, 2 if o else 3), name=n), ODD,
         mismatch("shape", "(4, 3)", "(4, 2)", "ranks [1]", "same shape")),
    Case("allreduce.zero_dim", lambda h, o, n, s: h.allreduce(torch.tensor(1.0), op=h.Sum, name=n), ALL, None,
         _sum_of_ones),
    Case("allreduce.zero_dim_vs_one", lambda h, o, n, s: h.allreduce(ones(1) if o else torch.tensor(1.0), name=n),
         ODD, mismatch("shape", "()", "(1,)")),
    Case("allreduce.non_contiguous", lambda h, o, n, s: h.allreduce(ones(3, 2).t(), op=h.Sum, name=n), ALL, None,
         _sum_of_ones),
    Case("allreduce_.non_contiguous", lambda h, o, n, s: h.allreduce_(ones(3, 2).t() if o else ones(2, 3), name=n),
         ALL, raises(ValueError, "contiguous")),
    Case("allreduce_.non_contiguous_one_rank",
         lambda h, o, n, s: h.allreduce_(ones(3, 2).t() if o else ones(2, 3), name=n), ODD,
         raises(ValueError, "contiguous", scope=ODD_ONLY)),
    Case("allreduce.none", lambda h, o, n, s: h.allreduce(None if o else ones(2), name=n), ALL,
         raises(TypeError, "torch.Tensor", "NoneType")),
    Case("allreduce_async.none_one_rank", lambda h, o, n, s: h.synchronize(h.allreduce_async(None if o else ones(2),
                                                                                             name=n)),
         ODD, raises(TypeError, "torch.Tensor", "NoneType", scope=ODD_ONLY)),
    Case("allreduce.list", lambda h, o, n, s: h.allreduce([1.0, 2.0] if o else ones(2), name=n), ALL,
         raises(TypeError, "torch.Tensor", "list")),
    Case("allreduce.op_invalid", lambda h, o, n, s: h.allreduce(ones(2), op=99 if o else h.Sum, name=n), ALL,
         raises(ValueError, "unknown reduction op 99", "Average, Sum")),
    Case("allreduce.op_invalid_one_rank", lambda h, o, n, s: h.allreduce(ones(2), op=99 if o else h.Sum, name=n),
         ODD, raises(ValueError, "unknown reduction op 99", scope=ODD_ONLY)),
    Case("allreduce.op_string", lambda h, o, n, s: h.allreduce(ones(2), op="sum" if o else h.Sum, name=n), ALL,
         raises(ValueError, "unknown reduction op 'sum'")),
    Case("allreduce.adasum_int", lambda h, o, n, s: h.allreduce(ones(2, dtype=torch.int32), op=h.Adasum, name=n),
         ALL, raises(ValueError, "Adasum", "floating-point", "int32")),
    Case("allreduce.average_bool", lambda h, o, n, s: h.allreduce(ones(2, dtype=torch.bool), name=n), ALL,
         raises(ValueError, "Average", "bool", "Sum, Min or Max")),
    Case("allreduce.average_int", lambda h, o, n, s: h.allreduce(ones(2, dtype=torch.int64) * 3, name=n), ALL, None,
         lambda h, out: torch.equal(out, ones(2, dtype=torch.int64) * 3) or pytest.fail(str(out))),
    Case("allreduce.op_differs", lambda h, o, n, s: h.allreduce(ones(2), op=h.Max if o else h.Sum, name=n), ODD,
         mismatch("reduce_op", "Sum", "Max", "same op")),
    Case("allreduce.average_and_op", lambda h, o, n, s: h.allreduce(ones(2), average=True, op=h.Sum, name=n), ALL,
         raises(ValueError, "supersedes average")),
    Case("allreduce.postscale_differs", lambda h, o, n, s: h.allreduce(ones(2), postscale_factor=2.0 if o else 1.0,
                                                                       name=n), ODD,
         mismatch("postscale_factor", "2.0", "1.0")),
    Case("allreduce.name_reused_new_shape",
         lambda h, o, n, s: (h.allreduce(ones(2), op=h.Sum, name=n), h.allreduce(ones(5), op=h.Sum, name=n))[1],
         ALL, None, _sum_of_ones),
    Case("allreduce.set_not_registered", lambda h, o, n, s: h.allreduce(ones(2), name=n, process_set=s["unknown"]),
         ALL, raises(ValueError, "not registered", "add_process_set")),
    Case("allreduce.set_removed", lambda h, o, n, s: h.allreduce(ones(2), name=n, process_set=s["removed"]), ALL,
         raises(ValueError, "not registered")),
    Case("allreduce.set_not_member", lambda h, o, n, s: h.allreduce(ones(2), op=h.Sum, name=n,
                                                                    process_set=s["but1"]), ODD,
         raises(ValueError, "rank 1 is not a member", "(ranks [0", scope=ODD_ONLY), recover=False),
    Case("grouped_allreduce.none_inside", lambda h, o, n, s: h.grouped_allreduce([ones(2), None if o else ones(2)],
                                                                                 name=n), ALL,
         raises(TypeError, "torch.Tensor", "NoneType")),
    Case("grouped_allreduce.empty", lambda h, o, n, s: h.grouped_allreduce([], name=n), ALL, None,
         lambda h, out: out == [] or pytest.fail(str(out))),
    Case("grouped_allreduce.dtype_differs_inside",
         lambda h, o, n, s: h.grouped_allreduce([ones(2), ones(2, dtype=torch.float64 if o else torch.float32)],
                                                name=n), ODD,
         mismatch("grouped_allreduce.dtype_differs_inside.1", "dtype", "float64", "float32")),
    Case("grouped_allreduce_.non_contiguous", lambda h, o, n, s: h.grouped_allreduce_([ones(2), ones(3, 2).t()],
                                                                                      name=n), ALL,
         raises(ValueError, "contiguous")),
    Case("grouped_allreduce_async.op_invalid",
         lambda h, o, n, s: h.synchronize(h.grouped_allreduce_async([ones(2)], op=-1, name=n)), ALL,
         raises(ValueError, "unknown reduction op -1")),
    Case("allreduce.prescale_not_number", lambda h, o, n, s: h.allreduce(ones(2), prescale_factor="x", name=n), ALL,
         raises(TypeError, "prescale_factor and postscale_factor must be numbers", "'x'")),
    Case("allreduce.postscale_nan", lambda h, o, n, s: h.allreduce(ones(2), postscale_factor=float("nan"), name=n),
         ALL, raises(ValueError, "must be finite", "nan")),
    Case("allreduce_async_.prescale_inf",
         lambda h, o, n, s: h.synchronize(h.allreduce_async_(ones(2), prescale_factor=float("inf"), name=n)), ALL,
         raises(ValueError, "must be finite", "inf")),
    Case("allreduce.process_set_none", lambda h, o, n, s: h.allreduce(ones(2), name=n, process_set=None), ALL,
         raises(TypeError, "process_set must be a ProcessSet", "NoneType")),
    Case("allreduce.process_set_id", lambda h, o, n, s: h.allreduce(ones(2), name=n, process_set=0), ALL,
         raises(TypeError, "process_set must be a ProcessSet", "int 0")),
    Case("grouped_allreduce.single_tensor", lambda h, o, n, s: h.grouped_allreduce(ones(2, 2), name=n), ALL,
         raises(TypeError, "expected a list of tensors, got Tensor", "wrap a single tensor")),
    Case("grouped_allreduce_async_.single_tensor",
         lambda h, o, n, s: h.grouped_allreduce_async_(ones(2, 2), name=n), ALL,
         raises(TypeError, "expected a list of tensors")),
    Case("grouped_allreduce_async.tuple", lambda h, o, n, s: h.synchronize(h.grouped_allreduce_async(
        (ones(2), ones(3)), op=h.Sum, name=n)), ALL, None, lambda h, out: [_sum_of_ones(h, t) for t in out]),
    Case("sparse_allreduce_async.dense", lambda h, o, n, s: h.sparse_allreduce_async(ones(2), n, h.Sum)(), ALL,
         raises(ValueError, "sparse COO tensor")),
]


# -- allgather, broadcast, objects ----------------------------------------------------------------------------
GATHER_BROADCAST = [
    Case("allgather.trailing_differs", lambda h, o, n, s: h.allgather(ones(2, 4 if o else 3), name=n), ODD,
         mismatch("allgather.allgather.trailing_differs", "shape after the first dimension", "(4,)", "(3,)",
                  "only the first dimension may differ")),
    Case("allgather.dtype_differs", lambda h, o, n, s: h.allgather(ones(2, dtype=torch.int64 if o else
                                                                       torch.float32), name=n), ODD,
         mismatch("dtype", "int64", "float32")),
    Case("allgather.rank_differs", lambda h, o, n, s: h.allgather(ones(2, 2, 1) if o else ones(2, 2), name=n), ODD,
         mismatch("shape after the first dimension", "(2, 1)", "(2,)")),
    Case("allgather.zero_dim", lambda h, o, n, s: h.allgather(torch.tensor(1.0), name=n), ALL, None,
         lambda h, out: tuple(out.shape) == (h.size(),) or pytest.fail(str(out.shape))),
    Case("allgather.empty_first_dim_one_rank", lambda h, o, n, s: h.allgather(ones(0 if o else 2, 3), name=n), ODD,
         None, lambda h, out: tuple(out.shape) == (2 * (h.size() - 1), 3) or pytest.fail(str(out.shape))),
    Case("allgather.non_contiguous", lambda h, o, n, s: h.allgather(ones(3, 2).t(), name=n), ALL, None,
         lambda h, out: tuple(out.shape) == (2 * h.size(), 3) or pytest.fail(str(out.shape))),
    Case("allgather.none", lambda h, o, n, s: h.allgather(None, name=n), ALL, raises(TypeError, "NoneType")),
    Case("grouped_allgather.none_inside", lambda h, o, n, s: h.grouped_allgather([ones(1), None], name=n), ALL,
         raises(TypeError, "NoneType")),
    Case("allgather_async.none_one_rank", lambda h, o, n, s: h.synchronize(h.allgather_async(None if o else ones(1),
                                                                                             name=n)), ODD,
         raises(TypeError, "NoneType", scope=ODD_ONLY)),
    Case("grouped_allgather.complex_inside",
         lambda h, o, n, s: h.grouped_allgather([ones(1), ones(1, dtype=torch.complex128)], name=n), ALL,
         raises(ValueError, "ComplexDoubleTensor", "not supported")),
    Case("grouped_allgather.single_tensor", lambda h, o, n, s: h.grouped_allgather(ones(2, 2), name=n), ALL,
         raises(TypeError, "expected a list of tensors")),
    Case("grouped_allgather_async.empty", lambda h, o, n, s: h.synchronize(h.grouped_allgather_async([], name=n)),
         ALL, None, lambda h, out: out == [] or pytest.fail(str(out))),
    Case("allgather.set_not_registered", lambda h, o, n, s: h.allgather(ones(1), name=n, process_set=s["unknown"]),
         ALL, raises(ValueError, "not registered")),
    Case("allgather_object.unpicklable", lambda h, o, n, s: h.allgather_object(
        _Unpicklable() if o else 1, name=n), ALL,
         raises(TypeError, "cannot be pickled")),
    Case("allgather_object.unpicklable_one_rank",
         lambda h, o, n, s: h.allgather_object(_Unpicklable() if o else 1, name=n), ODD,
         raises(TypeError, "cannot be pickled", scope=ODD_ONLY)),
    Case("broadcast.root_too_large", lambda h, o, n, s: h.broadcast(ones(2), h.size(), name=n), ALL,
         raises(ValueError, "root_rank {size} is not a rank of the process set")),
    Case("broadcast.root_negative", lambda h, o, n, s: h.broadcast(ones(2), -1, name=n), ALL,
         raises(ValueError, "root_rank -1 is not a rank")),
    Case("broadcast.root_not_int", lambda h, o, n, s: h.broadcast(ones(2), 0.5, name=n), ALL,
         raises(TypeError, "root_rank must be an int", "float 0.5")),
    Case("broadcast.root_none", lambda h, o, n, s: h.broadcast(ones(2), None, name=n), ALL,
         raises(TypeError, "root_rank must be an int", "NoneType None")),
    Case("broadcast.root_too_large_one_rank", lambda h, o, n, s: h.broadcast(ones(2), h.size() if o else 0, name=n),
         ODD, raises(ValueError, "root_rank {size} is not a rank", scope=ODD_ONLY)),
    Case("broadcast.root_differs", lambda h, o, n, s: h.broadcast(ones(2), 1 if o else 0, name=n), ODD,
         mismatch("root_rank", "every rank must pass the same root_rank")),
    Case("broadcast.shape_differs", lambda h, o, n, s: h.broadcast(ones(3 if o else 2), 0, name=n), ODD,
         mismatch("broadcast.broadcast.shape_differs", "shape", "(3,)", "(2,)")),
    Case("broadcast.dtype_differs", lambda h, o, n, s: h.broadcast(ones(2, dtype=torch.float16 if o else
                                                                       torch.float32), 0, name=n), ODD,
         mismatch("dtype", "float16", "float32")),
    Case("broadcast.zero_dim", lambda h, o, n, s: h.broadcast(torch.tensor(float(h.rank())), 0, name=n), ALL, None,
         lambda h, out: out.item() == 0.0 or pytest.fail(str(out))),
    Case("broadcast.non_contiguous", lambda h, o, n, s: h.broadcast(ones(3, 2).t() * (h.rank() + 1), 0, name=n),
         ALL, None, lambda h, out: torch.equal(out, ones(2, 3)) or pytest.fail(str(out))),
    Case("broadcast_.non_contiguous", lambda h, o, n, s: h.broadcast_(ones(3, 2).t(), 0, name=n), ALL,
         raises(ValueError, "contiguous")),
    Case("broadcast_object.root_float", lambda h, o, n, s: h.broadcast_object(1, 0.0, name=n), ALL,
         raises(TypeError, "root_rank must be an int", "float 0.0")),
    Case("broadcast.root_numpy_int", lambda h, o, n, s: h.broadcast(ones(2) * h.rank(), np.int64(1), name=n), ALL,
         None, lambda h, out: torch.equal(out, ones(2)) or pytest.fail(str(out))),
    Case("broadcast_async_.root_differs", lambda h, o, n, s: h.synchronize(h.broadcast_async_(ones(2), 1 if o else 0,
                                                                                            name=n)), ODD,
         mismatch("broadcast.broadcast_async_.root_differs", "root_rank")),
    Case("broadcast_.none", lambda h, o, n, s: h.broadcast_(None, 0, name=n), ALL, raises(TypeError, "NoneType")),
    Case("broadcast_async.root_outside_set",
         lambda h, o, n, s: h.synchronize(h.broadcast_async(ones(2), 1, name=n, process_set=s["but1"])), ALL,
         raises(ValueError, "(ranks [0")),
    Case("broadcast_object.root_too_large", lambda h, o, n, s: h.broadcast_object(1, h.size(), name=n), ALL,
         raises(ValueError, "root_rank {size} is not a rank")),
    Case("broadcast_object.root_differs", lambda h, o, n, s: h.broadcast_object(1, 1 if o else 0, name=n), ODD,
         mismatch("root_rank")),
    # Only the root pickles; it raises before sending anything, so the others are not made to call it here.
    Case("broadcast_object.unpicklable_root",
         lambda h, o, n, s: h.broadcast_object(_Unpicklable(), 1, name=n) if o else None, ODD,
         raises(TypeError, "cannot be pickled", scope=ODD_ONLY)),
]


class _Unpicklable:
    def __reduce__(self):
        raise TypeError("this object cannot be pickled")


# -- alltoall, reducescatter, barrier, join ---------------------------------------------------------------------
def _alltoall(h, rows, splits, name, trailing=(2,), dtype=torch.float32):
    return h.alltoall(ones(rows, *trailing, dtype=dtype), splits=splits, name=name)


def _even(h):
    return [1] * h.size()


def _join_while_other_broadcasts(h, odd, name, sets):
    """Rank 1 joins; the others broadcast first (an error: only allreduce runs while a rank has joined), then
    join too."""
    if odd:
        return h.join()
    with pytest.raises(h.HorovodInternalError, match="only allreduce can run until every rank has joined"):
        h.broadcast(ones(2), 0, name=name)
    return h.join()


OTHERS = [
    Case("alltoall.splits_sum_too_small", lambda h, o, n, s: _alltoall(h, h.size() + 1, _even(h), n), ALL,
         raises(ValueError, "must be non-negative and sum to the first dimension")),
    Case("alltoall.splits_negative", lambda h, o, n, s: _alltoall(h, 1, [2, -1] + [0] * (h.size() - 2), n), ALL,
         raises(ValueError, "non-negative", "[2, -1")),
    Case("alltoall.splits_wrong_length", lambda h, o, n, s: _alltoall(h, 3, [1, 1, 1, 0], n), ALL,
         raises(ValueError, "splits has 4 entries but the process set has {size} ranks")),
    Case("alltoall.splits_sum_one_rank", lambda h, o, n, s: _alltoall(h, h.size(), [2] * h.size() if o
                                                                      else _even(h), n), ODD,
         raises(ValueError, "sum to the first dimension", scope=ODD_ONLY)),
    Case("alltoall.not_divisible", lambda h, o, n, s: _alltoall(h, h.size() + 1, None, n), ALL,
         raises(ValueError, "divisible by the number of ranks")),
    Case("alltoall.zero_dim", lambda h, o, n, s: h.alltoall(torch.tensor(1.0), name=n), ALL,
         raises(ValueError, "divisible")),
    Case("alltoall.trailing_differs", lambda h, o, n, s: _alltoall(h, h.size(), _even(h), n, (3,) if o else (2,)),
         ODD, mismatch("alltoall.alltoall.trailing_differs", "shape after the first dimension")),
    Case("alltoall.dtype_differs", lambda h, o, n, s: _alltoall(h, h.size(), _even(h), n,
                                                                dtype=torch.int8 if o else torch.float32), ODD,
         mismatch("dtype", "int8", "float32")),
    Case("alltoall.uneven_splits", lambda h, o, n, s: _alltoall(h, h.size() + 1, [2] + [1] * (h.size() - 1), n),
         ALL, None, lambda h, out: tuple(out[0].shape)[1:] == (2,) or pytest.fail(str(out))),
    Case("alltoall.splits_fractional", lambda h, o, n, s: _alltoall(h, h.size(), [1.5] + [1.0] * (h.size() - 2)
                                                                    + [0.5], n), ALL,
         raises(TypeError, "splits must be integers", "float64")),
    # (the same error is a ValueError too: Horovod raises ValueError there, and its users catch that)
    Case("alltoall.splits_float_tensor", lambda h, o, n, s: _alltoall(h, h.size(), torch.ones(h.size()), n), ALL,
         raises(ValueError, "splits must be integers", "float32")),
    Case("alltoall.splits_text", lambda h, o, n, s: _alltoall(h, h.size(), "ab", n), ALL,
         raises(TypeError, "splits must be integers")),
    Case("alltoall.splits_tensor", lambda h, o, n, s: _alltoall(h, h.size(), torch.ones(h.size(), dtype=torch.int32),
                                                                n), ALL, None,
         lambda h, out: tuple(out[0].shape) == (h.size(), 2) or pytest.fail(str(out))),
    Case("alltoall_async.splits_wrong_length_one_rank", lambda h, o, n, s: h.synchronize(h.alltoall_async(
        ones(h.size()), splits=[h.size()] if o else _even(h), name=n)), ODD,
         raises(ValueError, "splits has 1 entries", scope=ODD_ONLY)),
    Case("alltoall.none", lambda h, o, n, s: h.alltoall(None, name=n), ALL, raises(TypeError, "NoneType")),
    Case("reducescatter.zero_dim", lambda h, o, n, s: h.reducescatter(torch.tensor(1.0), name=n), ALL,
         raises(ValueError, "at least one dimension")),
    Case("reducescatter.adasum", lambda h, o, n, s: h.reducescatter(ones(4), op=h.Adasum, name=n), ALL,
         raises(NotImplementedError, "Adasum")),
    Case("reducescatter.op_invalid", lambda h, o, n, s: h.reducescatter(ones(4), op=42, name=n), ALL,
         raises(ValueError, "42")),
    Case("reducescatter.shape_differs", lambda h, o, n, s: h.reducescatter(ones(4, 3 if o else 2), name=n), ODD,
         mismatch("reducescatter.reducescatter.shape_differs", "shape", "(4, 3)", "(4, 2)")),
    Case("reducescatter.fewer_rows_than_ranks", lambda h, o, n, s: h.reducescatter(ones(1, 2), op=h.Sum, name=n),
         ALL, None, lambda h, out: tuple(out.shape) == ((1 if h.rank() == 0 else 0), 2) or pytest.fail(str(out))),
    Case("reducescatter.average_bool", lambda h, o, n, s: h.reducescatter(ones(4, dtype=torch.bool), name=n), ALL,
         raises(ValueError, "Average", "bool")),
    Case("reducescatter.none", lambda h, o, n, s: h.reducescatter(None, name=n), ALL,
         raises(TypeError, "NoneType")),
    Case("reducescatter.postscale_nan", lambda h, o, n, s: h.reducescatter(ones(4), postscale_factor=float("nan"),
                                                                        name=n), ALL,
         raises(ValueError, "perseus.reducescatter", "must be finite")),
    Case("reducescatter_async.none_one_rank", lambda h, o, n, s: h.synchronize(h.reducescatter_async(
        None if o else ones(4), name=n)), ODD, raises(TypeError, "NoneType", scope=ODD_ONLY)),
    Case("grouped_reducescatter.single_tensor", lambda h, o, n, s: h.grouped_reducescatter(ones(4, 2), name=n), ALL,
         raises(TypeError, "expected a list of tensors")),
    Case("grouped_reducescatter_async.single_tensor",
         lambda h, o, n, s: h.grouped_reducescatter_async(ones(4, 2), name=n), ALL,
         raises(TypeError, "expected a list of tensors")),
    Case("grouped_reducescatter.zero_dim_inside",
         lambda h, o, n, s: h.grouped_reducescatter([ones(2), torch.tensor(1.0)], name=n), ALL,
         raises(ValueError, "at least one dimension")),
    Case("grouped_reducescatter.dtype_differs_inside",
         lambda h, o, n, s: h.grouped_reducescatter([ones(2), ones(2, dtype=torch.int32 if o else torch.float32)],
                                                    op=h.Sum, name=n), ODD,
         mismatch("reducescatter.grouped_reducescatter.dtype_differs_inside.1", "dtype")),
    Case("barrier.set_not_registered", lambda h, o, n, s: h.barrier(process_set=s["unknown"]), ALL,
         raises(ValueError, "not registered")),
    Case("barrier.set_not_member", lambda h, o, n, s: h.barrier(process_set=s["but1"]), ODD,
         raises(ValueError, "rank 1 is not a member", scope=ODD_ONLY), recover=False),
    Case("join.broadcast_while_joined", _join_while_other_broadcasts, ODD, None,
         lambda h, out: isinstance(out, int) or pytest.fail(str(out))),
    Case("join.device_ignored", lambda h, o, n, s: h.join(device=3), ALL, None,
         lambda h, out: 0 <= out < h.size() or pytest.fail(str(out))),
    Case("poll.unknown_handle", lambda h, o, n, s: h.poll(123456789), ALL, raises(ValueError, "123456789")),
    Case("synchronize.unknown_handle", lambda h, o, n, s: h.synchronize(123456789), ALL, None,
         lambda h, out: out is None or pytest.fail(str(out))),
    Case("broadcast_optimizer_state.none", lambda h, o, n, s: h.broadcast_optimizer_state(None, 0), ALL,
         raises(TypeError, "expected a torch.optim optimizer, got NoneType")),
    Case("broadcast_optimizer_state.root_too_large", lambda h, o, n, s: h.broadcast_optimizer_state(
        torch.optim.SGD([torch.nn.Parameter(ones(2))], lr=0.1, momentum=0.9), h.size()), ALL,
         raises(ValueError, "root_rank {size} is not a rank")),
    Case("broadcast_parameters.not_tensors", lambda h, o, n, s: h.broadcast_parameters([("w", 3)], 0), ALL,
         raises(ValueError, "'w' is a int, not a tensor", "broadcast_object")),
]

CASES = ALLREDUCE + GATHER_BROADCAST + OTHERS


@pytest.fixture(scope="module")
def sets(hvd):
    from perseus.runtime.process_sets import ProcessSet

    # The first optimizer step of a process imports torch._dynamo (seconds on a busy machine): not timed here.
    warm = torch.nn.Parameter(ones(1))
    warm.grad = ones(1)
    torch.optim.SGD([warm], lr=0.1).step()
    but1 = hvd.add_process_set([r for r in range(hvd.size()) if r != 1])  # every rank but rank 1
    removed = hvd.add_process_set([hvd.size() - 1])
    hvd.remove_process_set(removed)
    yield {"but1": but1, "unknown": ProcessSet([0]), "removed": removed}
    hvd.remove_process_set(but1)


def _words(words, hvd):
    return [w.format(size=hvd.size(), rank=hvd.rank()) for w in words]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(hvd, sets, case):
    if hvd.size() < 2:
        pytest.skip("the table needs 2+ ranks (run it under mpirun -np 2 and -np 3)")
    odd = case.who == ALL or hvd.rank() == 1
    name = case.id
    start = time.monotonic()
    expect = case.expect
    if expect is not None and (expect.scope == EVERY or odd):
        with pytest.raises(expect.exc) as info:
            case.call(hvd, odd, name, sets)
        message = str(info.value)
        for w in _words(expect.words, hvd):
            assert w in message, f"{w!r} not in {message!r}"
        if expect.scope == ODD_ONLY and case.who == ODD and case.recover:
            case.call(hvd, False, name, sets)  # the rank recovers: the others' request completes
    else:
        out = case.call(hvd, odd, name, sets)
        if case.check is not None:
            case.check(hvd, out)
    took = time.monotonic() - start
    assert took < LIMIT_S, f"{case.id} took {took:.1f} s on rank {hvd.rank()}"
    after = hvd.allreduce(ones(2), op=hvd.Sum, name=f"after.{case.id}")
    assert after.tolist() == [hvd.size()] * 2

