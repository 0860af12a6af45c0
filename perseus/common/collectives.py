"""Framework-neutral collectives on NumPy buffers: naming, validation and submission to the engine.

Framework adapters convert their tensors to C-contiguous NumPy views (zero-copy), call these functions, and
convert results back. Every function validates on the caller's thread (``ValueError``/``TypeError``/
``NotImplementedError``) before anything reaches the engine, and returns an int handle for
:func:`synchronize`/:func:`poll`.

Collective: every rank of ``process_set`` must make the same calls, in the same order for unnamed requests,
with the same name, dtype, shape (first dimension excepted for allgather/alltoall), op and root.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Sequence

import numpy as np

from perseus.common.basics import state
from perseus.common.process_sets import ProcessSet, global_process_set
from perseus.common.reduce_ops import ReduceOp, reject_adasum
from perseus.engine.handles import HandleTable
from perseus.engine.messages import DType, Entry, OpType, dtype_of, make_signature

__all__ = [
    "allreduce_async", "grouped_allreduce_async", "allgather_async", "grouped_allgather_async",
    "broadcast_async", "alltoall_async", "reducescatter_async", "grouped_reducescatter_async",
    "barrier", "join", "poll", "synchronize", "handles", "even_splits",
]

handles = HandleTable()
_barrier_lock = threading.Lock()
_barrier_counts: dict[int, int] = {}

Alloc = Callable[[tuple], np.ndarray]


_noname_lock = threading.Lock()
_noname_counts: dict = {}


def _name(prefix: str, name: Optional[str], ps_id: int) -> str:
    """``prefix.name``, or ``prefix.noname.N`` with N counting this op's unnamed calls on this process set,
    so that ranks making the same calls in the same order generate the same names."""
    if name is not None:
        return f"{prefix}.{name}"
    with _noname_lock:
        n = _noname_counts.get((prefix, ps_id), 0) + 1
        _noname_counts[(prefix, ps_id)] = n
    return f"{prefix}.noname.{n}"


def _reset_job_state() -> None:
    """Forget this job's handles and the counters that name unnamed requests and barriers (at shutdown), so
    that after an elastic reset every rank numbers its requests from 1 again."""
    handles.clear()
    with _noname_lock:
        _noname_counts.clear()
    with _barrier_lock:
        _barrier_counts.clear()


state().register_job_state(_reset_job_state)


def _info(process_set: ProcessSet):
    return state().process_set_info(process_set)


def _check(array: np.ndarray, what: str) -> DType:
    if not isinstance(array, np.ndarray):
        raise TypeError(f"perseus.{what}: expected a tensor, got {type(array).__name__}")
    if not array.flags.c_contiguous:
        raise ValueError("Tensor is required to be contiguous.")
    return dtype_of(array)


def _dt(dtypes, i: int, array: np.ndarray, what: str) -> DType:
    """The adapter-supplied dtype of item i, else the array's (DType.UINT8 is 0: never test it for truth)."""
    given = None if dtypes is None else dtypes[i]
    return given if given is not None else _check(array, what)


def _submit(entries: list[Entry], ps_id: int, finish) -> int:
    hs = state().engine.enqueue(entries, ps_id)
    return handles.register(hs, finish)


def allreduce_async(array: np.ndarray, output: np.ndarray, name: Optional[str] = None, op=ReduceOp.AVERAGE,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set, priority: int = 0,
                    dtype: Optional[DType] = None, finish: Callable[[list], Any] = lambda r: r[0]) -> int:
    """Start an allreduce of ``array`` into ``output`` (which may be ``array`` itself: in place)."""
    return grouped_allreduce_async([array], [output], name, op, prescale_factor, postscale_factor, process_set,
                                   priority, [dtype], finish, _single=True)


def grouped_allreduce_async(arrays: Sequence[np.ndarray], outputs: Sequence[np.ndarray], name=None,
                            op=ReduceOp.AVERAGE, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set, priority: int = 0,
                            dtypes=None, finish: Callable[[list], Any] = lambda r: r, _single=False) -> int:
    """Start allreduces of several arrays, negotiated together. Returns one handle for the group."""
    op = reject_adasum(op, "allreduce")
    ps_id, _, _ = _info(process_set)
    sigs = []
    for i, arr in enumerate(arrays):
        dt = _dt(dtypes, i, arr, "allreduce")
        if dt is DType.BOOL and op == ReduceOp.AVERAGE:
            raise ValueError("perseus.allreduce: op=Average is not defined for bool tensors; use Sum, Min or Max")
        sigs.append(make_signature(OpType.ALLREDUCE, dt, tuple(arr.shape), int(op), -1, float(prescale_factor),
                                   float(postscale_factor), int(priority)))
    base = _name("allreduce", name, ps_id)
    entries = [Entry(base if _single else f"{base}.{i}", sig, tuple(arr.shape), arr, out, process_set_id=ps_id)
               for i, (sig, arr, out) in enumerate(zip(sigs, arrays, outputs))]
    return _submit(entries, ps_id, finish)


def allgather_async(array: np.ndarray, alloc: Alloc, name=None, process_set=global_process_set,
                    priority: int = 0, dtype: Optional[DType] = None,
                    finish: Callable[[list], Any] = lambda r: r[0]) -> int:
    """Start an allgather: concatenate every rank's ``array`` along the first dimension."""
    return grouped_allgather_async([array], [alloc], name, process_set, priority, [dtype], finish, _single=True)


def grouped_allgather_async(arrays, allocs, name=None, process_set=global_process_set, priority: int = 0,
                            dtypes=None, finish=lambda r: r, _single=False) -> int:
    ps_id, _, _ = _info(process_set)
    items = []
    for i, arr in enumerate(arrays):
        dt = _dt(dtypes, i, arr, "allgather")
        shape = tuple(arr.shape) if arr.ndim else (1,)
        items.append((make_signature(OpType.ALLGATHER, dt, shape[1:], priority=int(priority)), shape))
    base = _name("allgather", name, ps_id)
    entries = [Entry(base if _single else f"{base}.{i}", sig, shape, arr.reshape(shape), alloc=alloc,
                     process_set_id=ps_id)
               for i, ((sig, shape), arr, alloc) in enumerate(zip(items, arrays, allocs))]
    return _submit(entries, ps_id, finish)


def broadcast_async(array: np.ndarray, output: np.ndarray, root_rank: int, name=None,
                    process_set=global_process_set, priority: int = 0, dtype: Optional[DType] = None,
                    finish=lambda r: r[0]) -> int:
    """Start a broadcast of ``array`` from ``root_rank`` into ``output``.

    ``root_rank`` is a rank of the job (as in Horovod), and must belong to ``process_set``.
    """
    ps_id, size, _ = _info(process_set)
    root_rank = int(root_rank)
    members = state().process_set_ranks(ps_id)
    if root_rank not in members:
        raise ValueError(f"perseus.broadcast: root_rank {root_rank} is not a rank of the process set "
                         f"(ranks {members}); pass the root's global rank")
    dt = dtype if dtype is not None else _check(array, "broadcast")
    sig = make_signature(OpType.BROADCAST, dt, tuple(array.shape), root_rank=members.index(root_rank),
                         priority=int(priority))
    entry = Entry(_name("broadcast", name, ps_id), sig, tuple(array.shape), array, output, process_set_id=ps_id)
    return _submit([entry], ps_id, finish)


def even_splits(first_dim: int, size: int, what: str = "alltoall") -> np.ndarray:
    if first_dim % size:
        raise ValueError(f"perseus.{what}: the first dimension ({first_dim}) must be divisible by the number of "
                         f"ranks ({size}) when splits are not given")
    return np.full(size, first_dim // size, np.int64)


def alltoall_async(array: np.ndarray, splits: Optional[np.ndarray], alloc: Alloc, name=None,
                   process_set=global_process_set, priority: int = 0, dtype: Optional[DType] = None,
                   finish=lambda r: r[0]) -> int:
    """Start an alltoall: rows ``splits[i]`` of ``array`` go to rank i; received rows are concatenated."""
    ps_id, size, _ = _info(process_set)
    dt = dtype if dtype is not None else _check(array, "alltoall")
    shape = tuple(array.shape) if array.ndim else (1,)
    if splits is None:
        splits = even_splits(shape[0], size)
    splits = np.asarray(splits, np.int64).reshape(-1)
    if splits.size != size:
        raise ValueError(f"perseus.alltoall: splits has {splits.size} entries but the process set has {size} "
                         "ranks; give one count per rank")
    if (splits < 0).any() or int(splits.sum()) != shape[0]:
        raise ValueError(f"perseus.alltoall: splits {splits.tolist()} must be non-negative and sum to the first "
                         f"dimension ({shape[0]})")
    sig = make_signature(OpType.ALLTOALL, dt, shape[1:], priority=int(priority))
    entry = Entry(_name("alltoall", name, ps_id), sig, shape, array.reshape(shape), alloc=alloc, splits=splits,
                  process_set_id=ps_id)
    return _submit([entry], ps_id, finish)


def reducescatter_async(array, alloc: Alloc, name=None, op=ReduceOp.AVERAGE, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0, priority: int = 0, dtype=None,
                        finish=lambda r: r[0]) -> int:
    """Start a reducescatter: reduce across ranks, then rank r keeps its share of the first dimension."""
    return grouped_reducescatter_async([array], [alloc], name, op, process_set, prescale_factor,
                                       postscale_factor, priority, [dtype], finish, _single=True)


def grouped_reducescatter_async(arrays, allocs, name=None, op=ReduceOp.AVERAGE, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0, priority: int = 0, dtypes=None,
                                finish=lambda r: r, _single=False) -> int:
    op = reject_adasum(op, "reducescatter")
    if op not in (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT):
        raise ValueError(f"perseus.reducescatter: unsupported op {op!r}")
    ps_id, _, _ = _info(process_set)
    sigs = []
    for i, arr in enumerate(arrays):
        dt = _dt(dtypes, i, arr, "reducescatter")
        if arr.ndim == 0:
            raise ValueError("perseus.reducescatter: the tensor needs at least one dimension to scatter")
        sigs.append(make_signature(OpType.REDUCESCATTER, dt, tuple(arr.shape), int(op), -1,
                                   float(prescale_factor), float(postscale_factor), int(priority)))
    base = _name("reducescatter", name, ps_id)
    entries = [Entry(base if _single else f"{base}.{i}", sig, tuple(arr.shape), arr, alloc=alloc,
                     process_set_id=ps_id)
               for i, (sig, arr, alloc) in enumerate(zip(sigs, arrays, allocs))]
    return _submit(entries, ps_id, finish)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank of ``process_set`` has called barrier."""
    ps_id, _, _ = _info(process_set)
    with _barrier_lock:
        count = _barrier_counts.get(ps_id, 0) + 1
        _barrier_counts[ps_id] = count
    sig = make_signature(OpType.BARRIER, DType.UINT8, ())
    entry = Entry(f"barrier.{count}", sig, (0,), np.zeros(0, np.uint8), process_set_id=ps_id)
    state().engine.enqueue([entry], ps_id)[0].wait()


def join(process_set: ProcessSet = global_process_set) -> int:
    """Block until every rank has joined; meanwhile this rank contributes zeros to others' allreduces.

    Returns the rank that joined last.
    """
    ps_id, _, _ = _info(process_set)
    return state().engine.join(ps_id).wait()


def poll(handle: int) -> bool:
    return handles.poll(handle)


def synchronize(handle: int):
    return handles.synchronize(handle)


def on_done(handle_ids, callback) -> None:
    """Call ``callback()`` when every handle in ``handle_ids`` has finished (collect results with synchronize)."""
    handles.on_done(list(handle_ids), callback)

