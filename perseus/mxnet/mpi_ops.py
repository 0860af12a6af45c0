"""MXNet collectives on the perseus engine: Horovod's horovod.mxnet.mpi_ops surface.

Every collective is synchronous for the calling Python thread: it waits for MXNet's pending writes to its
inputs (as ``wait_to_read`` would), hands the NDArrays' memory to the engine, and returns once the result is
in the output NDArray, which is then ready to read. MXNet work on other arrays keeps running meanwhile.
(Horovod instead pushes its collectives onto MXNet's engine and returns at once; code that calls
``wait_to_read()``/``asnumpy()`` on the result, as Horovod code must, behaves the same.) ``priority`` is part of
the request, as in Horovod; every rank must pass the same value for a given name.

Collective: every rank of ``process_set`` makes the same calls with the same names (unnamed calls in the same
order), dtypes, shapes (first dimension excepted for allgather and alltoall), ops and roots. When ranks
disagree, every rank raises :class:`~perseus.mxnet._bridge.PerseusMXNetMismatchError`, an
``mxnet.base.MXNetError`` whose message names the tensor, the ranks and what differs.
"""

from __future__ import annotations

import mxnet as mx
import numpy as np

from perseus.runtime import collectives as _c
from perseus.lifecycle.api import (  # noqa: F401 - re-exported
    _basics, ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, init,
    is_homogeneous, is_initialized, local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported,
    nccl_built, rank, rocm_built, shutdown, size, start_timeline, stop_timeline,
)
from perseus.runtime.process_sets import ProcessSet, global_process_set
from perseus.lifecycle import add_process_set, remove_process_set
from perseus.base.reduce_ops import (Adasum, Average, Max, Min, Product, ReduceOp, Sum, reject_adasum,
                                       resolve_op)
from perseus.base.exceptions import PerseusInternalError
from perseus.base.partition import even_counts as reducescatter_rows
from perseus.compression import Reducer
from perseus.mxnet._bridge import (Output, Pending, PerseusMXNetValueError, WriteTarget, _message, check_ndarray,
                                   mx_error, ps_info, read_view)

__all__ = [
    "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline", "size", "local_size", "cross_size",
    "rank", "local_rank", "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built",
    "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "Average", "Sum", "Adasum",
    "Min", "Max", "Product", "ReduceOp", "allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_",
    "allgather", "grouped_allgather", "broadcast", "broadcast_", "alltoall", "reducescatter",
    "grouped_reducescatter", "handle_average_backwards_compatibility",
]


def handle_average_backwards_compatibility(op, average):
    """Horovod's op/average reconciliation: default Average; ValueError when both are given."""
    return resolve_op(op, average)


def _reduce_op(op, average, what: str) -> ReduceOp:
    return resolve_op(op, average)  # every allreduce form takes Adasum (floating-point tensors)


def _as_list(tensors, what: str) -> list:
    if isinstance(tensors, mx.nd.NDArray) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"perseus.mxnet.{what}: expected a list of NDArrays, got {type(tensors).__name__}")
    return list(tensors)


def _check_all(tensors, what: str):
    return [check_ndarray(t, what) for t in tensors]


# -- allreduce ----------------------------------------------------------------------------------------------
def _start_allreduce(tensors, inplace, op, name, priority, prescale_factor, postscale_factor, process_set,
                     what, single):
    dtypes = [check_ndarray(tensors[0], what)] if single else _check_all(tensors, what)
    ps_info(process_set)
    if inplace:
        targets = [WriteTarget(t) for t in tensors]
        inputs = outputs = [t.array for t in targets]
    else:
        targets = [WriteTarget(mx.nd.empty(t.shape, ctx=t.context, dtype=t.dtype), initialise=False)
                   for t in tensors]
        inputs, outputs = [read_view(t) for t in tensors], [t.array for t in targets]

    def finish(_results):
        return [t.commit() for t in targets]

    def submit():
        return _c.grouped_allreduce_async(inputs, outputs, name, op, prescale_factor, postscale_factor,
                                          process_set, priority, dtypes=dtypes, finish=finish, _single=single)
    return Pending(what, submit)


def reduce_with(reducer, groups, keys, inplace, op, prescale_factor, postscale_factor, process_set, what,
                local=None):
    """Reduce with a communicating compressor (a :class:`perseus.compression.Reducer`): each of ``groups`` (a
    list of NDArrays) is compressed as one vector under its key in ``keys``. Every group is submitted before
    the first is awaited. Returns one list of NDArrays per group: the inputs themselves when ``inplace``,
    else new ones. ``local`` (a :class:`perseus.compression.local_step.LocalStep`, the same for every group)
    is the compressor's momentum correction: the results are then averaged updates.

    Raises:
        PerseusMXNetValueError: a missing key, a non-floating-point NDArray, an op other than Sum/Average,
            ``local`` given to a compressor that does not take it.
        PerseusMXNetMismatchError, PerseusMXNetInternalError: the collective failed.
    """
    for key, group in zip(keys, groups):
        if not key:
            raise PerseusMXNetValueError(
                f"perseus.mxnet.{what}: {reducer!r} keeps state per tensor and needs a name: pass name= "
                "(DistributedTrainer and DistributedOptimizer name gradients after their parameters)")
        for t in group:
            check_ndarray(t, what)
            if not np.issubdtype(np.dtype(t.dtype), np.floating):
                raise PerseusMXNetValueError(f"perseus.mxnet.{what}: {type(reducer).__name__} compresses "
                                             f"floating-point NDArrays only; {key!r} is {np.dtype(t.dtype)}")
    if ReduceOp(op) not in (Sum, Average):
        raise PerseusMXNetValueError(f"perseus.mxnet.{what}: {type(reducer).__name__} reduces with Sum or Average "
                                     f"only, not {ReduceOp(op).name}")
    ps_info(process_set)
    extra = {} if local is None else {"local": local}
    started = []
    try:
        for key, group in zip(keys, groups):
            if not group:
                started.append((None, []))
                continue
            if inplace:
                targets = [WriteTarget(t) for t in group]
                inputs = outputs = [t.array for t in targets]
            else:
                targets = [WriteTarget(mx.nd.empty(t.shape, ctx=t.context, dtype=t.dtype), initialise=False)
                           for t in group]
                inputs, outputs = [read_view(t) for t in group], [t.array for t in targets]
            started.append((reducer.reduce_async(key, inputs, outputs, op, prescale_factor, postscale_factor,
                                                 process_set, **extra), targets))
        results = []
        for pending, targets in started:
            if pending is not None:
                pending.wait()
            results.append([t.commit() for t in targets])
        return results
    except PerseusInternalError as exc:
        raise mx_error(exc, what) from None
    except ValueError as exc:
        if isinstance(exc, PerseusMXNetValueError):
            raise
        raise PerseusMXNetValueError(_message(exc, what)) from None


def _compressed_allreduce(compression, tensors, inplace, op, name, prescale_factor, postscale_factor,
                          process_set, what):
    return reduce_with(compression, [list(tensors)], [name], inplace, op, prescale_factor, postscale_factor,
                       process_set, what)[0]


def allreduce(tensor, average=None, name=None, priority=0, prescale_factor=1.0, postscale_factor=1.0,
              process_set=global_process_set, op=None, compression=None):
    """Return a new NDArray with the reduction of ``tensor`` over the ranks of ``process_set``.

    ``op`` is Average (default), Sum, Min, Max or Product (``average`` is Horovod's deprecated spelling).
    The input is multiplied by ``prescale_factor`` before the reduction and the result by
    ``postscale_factor`` after it (integers are scaled in float64 and truncated, float16 in float32).

    ``compression`` (a perseus addition): a communicating compressor such as ``Compression.topk(0.01)``
    (docs/compression.md) reduces a floating-point NDArray with its own collective (Sum or Average) and gives
    its dense estimate; it keeps a residual per tensor, so ``name`` is required. ``None`` (or
    ``Compression.none``) reduces exactly.

    Raises:
        PerseusMXNetMismatchError: ranks disagree about name, shape, dtype, op or scale factors.
        NotImplementedError: a GPU NDArray.
        ValueError: op=Adasum on an integer NDArray.
    """
    op = _reduce_op(op, average, "allreduce")
    if isinstance(compression, Reducer):
        return _compressed_allreduce(compression, [tensor], False, op, name, prescale_factor, postscale_factor,
                                     process_set, "allreduce")[0]
    return _start_allreduce([tensor], False, op, name, priority, prescale_factor, postscale_factor, process_set,
                            "allreduce", True).wait()[0]


def allreduce_(tensor, average=None, name=None, priority=0, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set, op=None, compression=None):
    """Reduce ``tensor`` in place over the ranks of ``process_set`` and return it; see :func:`allreduce`."""
    op = _reduce_op(op, average, "allreduce_")
    if isinstance(compression, Reducer):
        return _compressed_allreduce(compression, [tensor], True, op, name, prescale_factor, postscale_factor,
                                     process_set, "allreduce_")[0]
    return _start_allreduce([tensor], True, op, name, priority, prescale_factor, postscale_factor, process_set,
                            "allreduce_", True).wait()[0]


def grouped_allreduce(tensors, average=None, name=None, priority=0, prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set, op=None, compression=None):
    """Return new NDArrays with the reduction of each tensor of ``tensors``, negotiated and fused together.

    Tensors are matched across ranks by position; see :func:`allreduce` for the arguments. A communicating
    ``compression`` compresses the group as one vector keyed by ``name``.
    """
    op = _reduce_op(op, average, "grouped_allreduce")
    if not _as_list(tensors, "grouped_allreduce"):
        return tensors
    if isinstance(compression, Reducer):
        return _compressed_allreduce(compression, tensors, False, op, name, prescale_factor, postscale_factor,
                                     process_set, "grouped_allreduce")
    return _start_allreduce(list(tensors), False, op, name, priority, prescale_factor, postscale_factor,
                            process_set, "grouped_allreduce", False).wait()


def grouped_allreduce_(tensors, average=None, name=None, priority=0, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set, op=None, compression=None):
    """Reduce each tensor of ``tensors`` in place, negotiated and fused together; return ``tensors``. See
    :func:`grouped_allreduce` for ``compression``."""
    op = _reduce_op(op, average, "grouped_allreduce_")
    if not _as_list(tensors, "grouped_allreduce_"):
        return tensors
    if isinstance(compression, Reducer):
        _compressed_allreduce(compression, tensors, True, op, name, prescale_factor, postscale_factor,
                              process_set, "grouped_allreduce_")
        return tensors
    _start_allreduce(list(tensors), True, op, name, priority, prescale_factor, postscale_factor, process_set,
                     "grouped_allreduce_", False).wait()
    return tensors


# -- allgather ----------------------------------------------------------------------------------------------
def _start_allgather(tensors, name, priority, process_set, what, single):
    dtypes = [check_ndarray(tensors[0], what)] if single else _check_all(tensors, what)
    ps_info(process_set)
    outs = [Output(t) for t in tensors]
    inputs = [read_view(t) for t in tensors]

    def finish(results):
        return [o.result(e) for o, e in zip(outs, results)]

    def submit():
        return _c.grouped_allgather_async(inputs, [o.alloc for o in outs], name, process_set, priority,
                                          dtypes=dtypes, finish=finish, _single=single)
    return Pending(what, submit)


def allgather(tensor, name=None, priority=0, process_set=global_process_set):
    """Concatenate ``tensor`` from every rank of ``process_set`` (in rank order) along the first dimension,
    which may differ between ranks; the other dimensions must agree. Returns a new NDArray."""
    return _start_allgather([tensor], name, priority, process_set, "allgather", True).wait()[0]


def grouped_allgather(tensors, name=None, priority=0, process_set=global_process_set):
    """Allgather each tensor of ``tensors``, negotiated together; returns a list of new NDArrays."""
    if not _as_list(tensors, "grouped_allgather"):
        return tensors
    return _start_allgather(list(tensors), name, priority, process_set, "grouped_allgather", False).wait()


# -- broadcast ----------------------------------------------------------------------------------------------
def _start_broadcast(tensor, root_rank, inplace, name, priority, process_set, what):
    dtype = check_ndarray(tensor, what)
    ps_info(process_set)
    if inplace:
        target = WriteTarget(tensor)
        src = target.array
    else:
        target = WriteTarget(mx.nd.empty(tensor.shape, ctx=tensor.context, dtype=tensor.dtype),
                             initialise=False)
        src = read_view(tensor)

    def submit():
        return _c.broadcast_async(src, target.array, root_rank, name, process_set, priority, dtype=dtype,
                                  finish=lambda r: target.commit())
    return Pending(what, submit)


def broadcast(tensor, root_rank, name=None, priority=0, process_set=global_process_set):
    """Return a new NDArray holding ``tensor`` as it is on ``root_rank`` (a job rank in ``process_set``).

    Raises:
        PerseusMXNetMismatchError: ranks disagree about the root, shape or dtype.
    """
    return _start_broadcast(tensor, root_rank, False, name, priority, process_set, "broadcast").wait()


def broadcast_(tensor, root_rank, name=None, priority=0, process_set=global_process_set):
    """Overwrite ``tensor`` with its value on ``root_rank`` and return it; see :func:`broadcast`."""
    return _start_broadcast(tensor, root_rank, True, name, priority, process_set, "broadcast_").wait()


# -- alltoall -----------------------------------------------------------------------------------------------
def _splits_array(splits):
    if splits is None:
        return None
    if isinstance(splits, mx.nd.NDArray):
        kind = np.dtype(splits.dtype).kind
        splits = splits.asnumpy()
    else:
        splits = np.asarray(splits)
        kind = splits.dtype.kind
    if kind not in "iu":
        raise PerseusMXNetValueError(f"perseus.mxnet.alltoall: splits must hold integers (int32 as in Horovod), "
                                     f"got {splits.dtype}")
    return splits.astype(np.int64).reshape(-1)


def alltoall(tensor, splits=None, name=None, priority=0, process_set=global_process_set):
    """Send rows ``splits[i]`` of ``tensor`` (first dimension) to rank i of ``process_set``; return the rows
    received, concatenated in rank order.

    Without ``splits`` the first dimension is divided evenly (it must be a multiple of the set's size) and
    only the output is returned; with ``splits`` (an int32 NDArray, list or NumPy array with one count per
    rank) the result is ``(output, received_splits)``, ``received_splits`` an int32 NDArray on the CPU.

    Raises:
        PerseusMXNetValueError: bad splits, or an uneven first dimension without splits.
        PerseusMXNetMismatchError: ranks disagree about dtype or the trailing dimensions.
    """
    want_splits = splits is not None
    dtype = check_ndarray(tensor, "alltoall")
    ps_info(process_set)
    counts = _splits_array(splits)
    out = Output(tensor)
    src = read_view(tensor)

    def finish(results):
        received = mx.nd.array(results[0].received_splits.astype(np.int32), ctx=mx.cpu(), dtype=np.int32)
        return out.result(results[0]), received

    def submit():
        return _c.alltoall_async(src, counts, out.alloc, name, process_set, priority, dtype=dtype, finish=finish)
    output, received = Pending("alltoall", submit).wait()
    return (output, received) if want_splits else output


# -- reducescatter ------------------------------------------------------------------------------------------
def _start_reducescatter(tensors, op, name, priority, process_set, prescale_factor, postscale_factor, what,
                         single):
    dtypes = [check_ndarray(tensors[0], what)] if single else _check_all(tensors, what)
    op = reject_adasum(op, f"mxnet.{what}")
    if any(t.ndim == 0 for t in tensors):
        raise PerseusMXNetValueError(f"perseus.mxnet.{what}: scalar inputs are not supported; the tensor needs a "
                                     "first dimension to scatter")
    _, set_size, set_rank = ps_info(process_set)
    outs = [Output(t, (reducescatter_rows(t.shape[0], set_size)[set_rank],) + tuple(t.shape[1:]))
            for t in tensors]
    inputs = [read_view(t) for t in tensors]

    def finish(results):
        return [o.result(e) for o, e in zip(outs, results)]

    def submit():
        return _c.grouped_reducescatter_async(inputs, [o.alloc for o in outs], name, op, process_set,
                                              prescale_factor, postscale_factor, priority, dtypes=dtypes,
                                              finish=finish, _single=single)
    return Pending(what, submit)


def reducescatter(tensor, op=Average, name=None, priority=0, process_set=global_process_set, prescale_factor=1.0,
                  postscale_factor=1.0):
    """Reduce ``tensor`` over the ranks of ``process_set`` and return this rank's share of the first dimension
    as a new NDArray (when it does not divide evenly, earlier ranks get one row more).

    ``op`` is Average (default) or Sum, as in Horovod; Min, Max and Product work too.

    Raises:
        PerseusMXNetValueError: a scalar input (also a ValueError).
        PerseusMXNetMismatchError: ranks disagree about shape, dtype, op or scale factors.
    """
    return _start_reducescatter([tensor], op, name, priority, process_set, prescale_factor, postscale_factor,
                                "reducescatter", True).wait()[0]


def grouped_reducescatter(tensors, op=Average, name=None, priority=0, process_set=global_process_set,
                          prescale_factor=1.0, postscale_factor=1.0):
    """Reducescatter each tensor of ``tensors``, negotiated together; returns a list of new NDArrays."""
    if not _as_list(tensors, "grouped_reducescatter"):
        return tensors
    return _start_reducescatter(list(tensors), op, name, priority, process_set, prescale_factor,
                                postscale_factor, "grouped_reducescatter", False).wait()
