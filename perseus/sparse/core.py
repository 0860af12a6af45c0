"""The framework-neutral sparse all-reduce: validation, the choice of algorithm, dispatch."""

from __future__ import annotations

from typing import Optional

import numpy as np

from perseus.runtime.process_sets import ProcessSet, global_process_set
from perseus.base.reduce_ops import ReduceOp
from perseus.sparse import _runtime, _format, allgather, choice, columns, dense, zen
from perseus.runtime.collectives import _name

__all__ = ["sparse_allreduce_async", "sparse_allreduce", "resolve_algorithm"]

_STARTS = {"zen": zen.start, "allgather": allgather.start, "dense": dense.start, "alltoall": columns.start}


def resolve_algorithm(algorithm: Optional[str]) -> str:
    """``algorithm``, or PERSEUS_SPARSE_ALGORITHM when None; ValueError for an unknown name."""
    if algorithm is None:
        algorithm = str(_runtime.settings().sparse_algorithm)
    algorithm = str(algorithm).lower()
    if algorithm not in choice.CHOICES:
        raise ValueError(f"perseus: unknown sparse algorithm {algorithm!r}; use one of {', '.join(choice.CHOICES)}")
    return algorithm


def _decide(ts: _runtime.TensorState, ss: _runtime.SetState, process_set, table_rows: int, width: int,
            row_bytes: int, index_bytes: int):
    """``(algorithm, how, predictions, setup)`` for an 'auto' call; the same on every rank (see choice.py)."""
    if table_rows < 0:
        return "allgather", "auto", None, False
    forced = choice.policy()
    if forced is not None:
        return forced, "policy", None, False
    prev = ts.inflight
    if prev is not None and not prev.done():
        # the previous call's facts feed this choice: every rank must have folded them in
        try:
            prev.wait()
        except Exception:  # noqa: BLE001 - its owner sees the error when it waits; the history stays as it was
            pass
    if ts.history is None:
        return "zen", "first call", None, True
    setup = ss.link is None
    link = _runtime.ensure_link(ss, process_set)
    work = ts.workload(ss.size, table_rows, row_bytes, index_bytes, width)
    preds = choice.predict(work, link)
    best, how, _ = choice.choose_measured(preds, ts.corrections, ts.tried, ts.choice)
    ts.tried[best] = ts.tried.get(best, 0) + 1
    ts.choice = best
    return best, how, preds, setup


def sparse_allreduce_async(rows, values, num_rows: Optional[int], name: Optional[str] = None,
                           op=ReduceOp.AVERAGE, process_set: ProcessSet = global_process_set,
                           algorithm: Optional[str] = None, coalesced: bool = False) -> _runtime.SparseHandle:
    """Start the reduction of a row-sparse tensor over the ranks of ``process_set``.

    Args:
        rows: the row ids (1-D integers in ``[0, num_rows)``; duplicates are summed first unless
            ``coalesced`` says they are sorted and unique already).
        values: ``values[i]`` is row ``rows[i]``'s value: shape ``(len(rows), *row_shape)``, a NumPy float
            (or integer, for Sum) array.
        num_rows: rows of the dense table (the first dimension of the dense tensor), or None when unknown
            (then only the allgather algorithm applies).
        name: the collective's name; every rank uses the same for the same tensor. Named tensors keep the
            measurements 'auto' chooses from and their :func:`perseus.sparse.stats`.
        op: ``ReduceOp.AVERAGE`` (default) or ``ReduceOp.SUM``.
        algorithm: 'auto', 'zen', 'allgather', 'dense' or 'alltoall'; None reads PERSEUS_SPARSE_ALGORITHM.

    Returns:
        a :class:`perseus.sparse.SparseHandle`; ``wait()`` gives the :class:`perseus.sparse.SparseResult`,
        identical on every rank.

    Collective: every rank of ``process_set`` calls it under the same name with a tensor of the same dense
    shape and dtype, the same op and algorithm (any number of rows, none included).

    Raises:
        ValueError: bad rows, shapes, op or algorithm (on the caller's thread).
        MismatchError, from ``wait()`` on every rank: the ranks disagree about the tensor.
    """
    algorithm = resolve_algorithm(algorithm)
    op, rows, values2, num_rows, row_shape = _checked(rows, values, num_rows, name, op, algorithm, coalesced)
    ss = _runtime.set_state(process_set)
    engine = _runtime.runtime().engine
    full = f"sparse.{name}" if name is not None else _name("sparse", None, ss.ps_id)
    ts = _runtime.tensor_state(ss.ps_id, full)
    ts.table = (num_rows, row_shape, values2.dtype.str)
    algorithm, how, predicted = _algorithm(algorithm, ts, ss, process_set, full, num_rows, values2)
    handle = _runtime.SparseHandle(full[len("sparse."):], algorithm, engine)
    if ss.size == 1:
        ts.inflight = handle
        local = _format.Table(full, num_rows, row_shape, values2.dtype, int(op), algorithm)
        call = _runtime.Call(engine, ss, local, rows, values2, handle, ts, how, predicted)
        ts.calls += 1
        call.finish(rows, values2.copy(), True, nnz=[rows.size], union=rows.size)
        return handle
    seed = 0
    if algorithm == "zen":
        seed = _runtime.ensure_seeds(ss, process_set).h0
    table = _format.Table(full, num_rows, row_shape, values2.dtype, int(op), algorithm, seed)
    call = _runtime.Call(engine, ss, table, rows, values2, handle, ts, how, predicted)
    ts.calls += 1
    ts.inflight = handle
    try:
        _STARTS[algorithm](call)
    except BaseException as exc:
        handle._resolve(error=exc)
        raise
    return handle


def _checked(rows, values, num_rows, name, op, algorithm: str, coalesced: bool):
    """sparse_allreduce_async's arguments checked and normalised: ``(op, rows as int64, values as a
    (rows, width) array, num_rows, row_shape)``, duplicates summed unless ``coalesced``. Local.

    Raises:
        ValueError: bad rows, shapes, dtype, op, or an algorithm that needs ``num_rows`` without it.
    """
    op = ReduceOp(int(op))
    if op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        raise ValueError(f"perseus.sparse_allreduce: only Sum and Average apply to sparse tensors, not {op.name}")
    values = np.asarray(values)
    rows = np.asarray(rows)
    if rows.ndim != 1 or (rows.size and rows.dtype.kind not in "iu"):
        raise ValueError(f"perseus.sparse_allreduce: rows must be a 1-D integer array, got shape {rows.shape} "
                         f"of {rows.dtype}")
    if values.ndim < 1 or values.shape[0] != rows.size:
        raise ValueError(f"perseus.sparse_allreduce: {rows.size} rows but values of shape {values.shape}")
    if values.dtype.kind not in "fiu":
        raise ValueError(f"perseus.sparse_allreduce: values of dtype {values.dtype} are not supported")
    if op == ReduceOp.AVERAGE and values.dtype.kind != "f":
        raise ValueError("perseus.sparse_allreduce: op=Average needs floating-point values; use Sum")
    if num_rows is not None:
        num_rows = int(num_rows)
        if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= num_rows):
            raise ValueError(f"perseus.sparse_allreduce({name!r}): row ids must be in [0, {num_rows}), got "
                             f"[{int(rows.min())}, {int(rows.max())}]")
    elif algorithm not in ("auto", "allgather"):
        raise ValueError(f"perseus.sparse_allreduce({name!r}): algorithm {algorithm!r} needs the number of rows "
                         "of the dense tensor; give a dense shape, or use allgather")
    row_shape = tuple(values.shape[1:])
    width = int(np.prod(row_shape, dtype=np.int64)) if row_shape else 1
    values2 = np.ascontiguousarray(values).reshape(rows.size, width)
    if not coalesced:
        rows, values2 = zen.coalesce(rows, values2)
    else:
        rows = rows.astype(np.int64, copy=False)
    return op, rows, values2, num_rows, row_shape


def _algorithm(algorithm: str, ts, ss, process_set, full: str, num_rows, values2):
    """The algorithm this call runs, why (``how``) and the predictions 'auto' chose from (or None); records
    the choice in the tensor's state. Collective under the autotuner (:func:`choice.follow_tuner`)."""
    width = values2.shape[1]
    if algorithm == "auto":
        if ss.ps_id == 0:
            choice.follow_tuner(full, process_set)  # under the autotuner: the step's algorithm, agreed
        table_rows = -1 if num_rows is None else num_rows
        x = 4 if 0 <= table_rows < (1 << 31) else 8
        algorithm, how, predicted, setup = _decide(ts, ss, process_set, table_rows, width,
                                                   width * values2.dtype.itemsize, x)
    else:
        how, predicted, setup = "explicit", None, False
    if algorithm == "zen" and ss.size > 1:
        setup = setup or ss.seeds is None or (num_rows <= zen.BITMAP_MAX_ROWS and
                                              not zen.is_cached(num_rows, ss.size, ss.seeds.h0))
    ts.remember(ts.calls, algorithm, None if predicted is None else predicted[algorithm].seconds, setup)
    return algorithm, how, predicted


def sparse_allreduce(rows, values, num_rows, name=None, op=ReduceOp.AVERAGE, process_set=global_process_set,
                     algorithm=None, coalesced=False) -> _runtime.SparseResult:
    """:func:`sparse_allreduce_async`, waited for."""
    return sparse_allreduce_async(rows, values, num_rows, name, op, process_set, algorithm, coalesced).wait()
