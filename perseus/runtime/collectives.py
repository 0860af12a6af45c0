"""Framework-neutral collectives on NumPy buffers: naming, validation and submission to the engine.

Framework adapters convert their tensors to C-contiguous NumPy views (zero-copy), call these functions, and
convert results back. Every function validates on the caller's thread (``ValueError``/``TypeError``/
``NotImplementedError``) before anything reaches the engine, and returns an int handle for
:func:`synchronize`/:func:`poll`.

Collective: every rank of ``process_set`` must make the same calls, in the same order for unnamed requests,
with the same name, dtype, shape (first dimension excepted for allgather/alltoall), op and root.
"""

from __future__ import annotations

import math
import operator
import threading
from typing import Any, Callable, Optional, Sequence

import numpy as np

from perseus.base.exceptions import BadArgumentTypeError
from perseus.runtime.state import runtime
from perseus.base.partition import even_counts
from perseus.runtime.process_sets import ProcessSet, global_process_set
from perseus.base.reduce_ops import ReduceOp, reject_adasum
from perseus.engine.messages import DType, OpType, Request, dtype_of

__all__ = [
    "allreduce_async", "grouped_allreduce_async", "allgather_async", "grouped_allgather_async",
    "broadcast_async", "alltoall_async", "reducescatter_async", "grouped_reducescatter_async",
    "barrier", "join", "poll", "synchronize", "on_done", "even_splits", "alltoall_splits", "root_in_set", "unnamed", "Result",
    "device_allreduce_async",
]

_barrier_lock = threading.Lock()
_barrier_counts: dict[int, int] = {}

Alloc = Callable[[tuple], np.ndarray]

_ALLREDUCE, _ALLGATHER, _BROADCAST = int(OpType.ALLREDUCE), int(OpType.ALLGATHER), int(OpType.BROADCAST)
_ALLTOALL, _REDUCESCATTER, _BARRIER = int(OpType.ALLTOALL), int(OpType.REDUCESCATTER), int(OpType.BARRIER)

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


def unnamed(prefix: str, process_set: ProcessSet) -> str:
    """The ``name=`` an unnamed call of op ``prefix`` on ``process_set`` gets, drawn now (in call order), for a
    submission made later from another thread (it then gets the same full name as if submitted now)."""
    ps_id = _info(process_set)[0]
    return _name(prefix, None, ps_id)[len(prefix) + 1:]


def _reset_job_state() -> None:
    """Forget the counters that name unnamed requests and barriers (at shutdown), so that after an elastic
    reset every rank numbers its requests from 1 again. (The engine's handles end with the engine.)"""
    with _noname_lock:
        _noname_counts.clear()
    with _barrier_lock:
        _barrier_counts.clear()


runtime().register_job_state(_reset_job_state)


def _info(process_set: ProcessSet):
    return runtime().process_set_info(process_set)


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


class Result:
    """What a request produced when its output size was decided by the collective (allgather, alltoall)."""

    __slots__ = ("output", "received_splits")

    def __init__(self, output, received_splits):
        self.output, self.received_splits = output, received_splits


def _gathered(allocs, finish):
    """A finish that first copies each engine-allocated result into the buffer the adapter allocates, or
    (alloc None) hands the engine's array itself over (it owns its memory: no copy)."""
    def done(results):
        out = []
        for alloc, res in zip(allocs, results):
            data, splits = res
            if alloc is None:
                out.append(Result(data, splits))
                continue
            target = alloc(data.shape)
            np.copyto(target, data.view(target.dtype) if target.dtype != data.dtype else data)
            out.append(Result(target, splits))
        return finish(out)
    return done


_runtime = runtime()


def _target(process_set: ProcessSet):
    """``(engine, process set id)`` for a request; the global set's is found without any lookup.

    Raises:
        ValueError: not initialised, or the set is not registered / this rank is not a member.
    """
    engine = _runtime.active_engine
    if engine is not None and process_set is global_process_set:
        return engine, 0
    ps_id, _, _ = _runtime.process_set_info(process_set)
    return _runtime.engine, ps_id


def _factors(prescale_factor, postscale_factor, what: str) -> tuple[float, float]:
    """The two scale factors as floats.

    Raises:
        TypeError: one is not a number. ValueError: one is NaN or infinite (a NaN never equals itself, so the
            ranks could not even agree on it).
    """
    try:
        pre, post = float(prescale_factor), float(postscale_factor)
    except (TypeError, ValueError):
        raise TypeError(f"perseus.{what}: prescale_factor and postscale_factor must be numbers, got "
                        f"{prescale_factor!r} and {postscale_factor!r}") from None
    if not (math.isfinite(pre) and math.isfinite(post)):
        raise ValueError(f"perseus.{what}: prescale_factor and postscale_factor must be finite, got {pre!r} and "
                         f"{post!r}")
    return pre, post


#: float16, bfloat16, float32, float64: what Adasum combines
_FLOATS = (5, 6, 7, 8)


def _adasum_dtype(dtype) -> None:
    raise ValueError(f"perseus.allreduce: op=Adasum needs floating-point tensors (float16, bfloat16, float32, "
                     f"float64), not {DType(int(dtype)).name.lower()}; use Sum or Average")


def allreduce_async(array, output, name: Optional[str] = None, op=ReduceOp.AVERAGE,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set, priority: int = 0,
                    dtype: Optional[DType] = None, finish: Callable[[list], Any] = lambda r: r[0],
                    shape: Optional[tuple] = None, keepalive=None) -> int:
    """Start an allreduce of ``array`` into ``output`` (which may be ``array`` itself: in place).

    The per-gradient path: one native call. ``array``/``output`` are NumPy arrays, or raw addresses (ints)
    with ``dtype``, ``shape`` and ``keepalive`` (what owns the memory until the request is collected).
    ``finish`` makes :func:`synchronize`'s value: a callable gets the list of results, a 1-tuple
    ``(value,)`` is returned as it is (no Python call on the way back).
    """
    op = int(op)
    engine, ps_id = _target(process_set)
    if dtype is None:
        dtype = _check(array, "allreduce")
    if dtype == 9 and op == 0:  # bool, Average
        raise ValueError("perseus.allreduce: op=Average is not defined for bool tensors; use Sum, Min or Max")
    if op == 2 and int(dtype) not in _FLOATS:
        _adasum_dtype(dtype)
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        prescale_factor, postscale_factor = _factors(prescale_factor, postscale_factor, "allreduce")
    return engine.submit_one(ps_id, _ALLREDUCE, _name("allreduce", name, ps_id), dtype,
                             array.shape if shape is None else shape, array, output, op, -1,
                             float(prescale_factor), float(postscale_factor), int(priority), None, finish,
                             (array, output) if keepalive is None else keepalive)


def grouped_allreduce_async(arrays: Sequence[np.ndarray], outputs: Sequence[np.ndarray], name=None,
                            op=ReduceOp.AVERAGE, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set, priority: int = 0,
                            dtypes=None, finish: Callable[[list], Any] = lambda r: r, _single=False) -> int:
    """Start allreduces of several arrays, negotiated together. Returns one handle for the group."""
    op = ReduceOp(int(op))
    ps_id, _, _ = _info(process_set)
    pre, post = _factors(prescale_factor, postscale_factor, "allreduce")
    op, priority = int(op), int(priority)
    base = _name("allreduce", name, ps_id)
    items = []
    for i, (arr, out) in enumerate(zip(arrays, outputs)):
        dt = _dt(dtypes, i, arr, "allreduce")
        if dt is DType.BOOL and op == ReduceOp.AVERAGE:
            raise ValueError("perseus.allreduce: op=Average is not defined for bool tensors; use Sum, Min or Max")
        if op == ReduceOp.ADASUM and int(dt) not in _FLOATS:
            _adasum_dtype(dt)
        items.append(Request(name=base if _single else f"{base}.{i}", dtype=int(dt), shape=arr.shape, input=arr,
                             output=out, reduce_op=op, prescale=pre, postscale=post, priority=priority))
    return runtime().engine.submit(ps_id, _ALLREDUCE, items, finish, (arrays, outputs))


def device_allreduce_async(shapes, dtypes, pointers, name, op, prescale_factor, postscale_factor, process_set,
                           finish, keepalive, register, single: bool, device: int) -> int:
    """Start allreduces of device tensors (``pointers`` into device memory), moved by a framework's launcher
    (:mod:`perseus.torch.device`) rather than the channels; return one handle. ``device`` (>= 0) is the
    launcher's code for the kind of memory, which every rank must agree on.

    ``register(ps_id, names, handle)`` is called with the requests' names once the engine has taken them (the
    launcher looks tensors up by name, waiting for this). Collective as :func:`grouped_allreduce_async`; the
    device kind is part of what ranks must agree on.
    """
    op = int(op)
    ps_id, _, _ = _info(process_set)
    pre, post = _factors(prescale_factor, postscale_factor, "allreduce")
    base = _name("allreduce", name, ps_id)
    names = [base] if single else [f"{base}.{i}" for i in range(len(shapes))]
    items = [Request(name=n, dtype=int(dt), shape=shape, input=ptr, output=ptr, reduce_op=op, prescale=pre,
                     postscale=post) for n, dt, shape, ptr in zip(names, dtypes, shapes, pointers)]
    handle = runtime().engine.submit(ps_id, _ALLREDUCE, items, finish, keepalive, int(device))
    register(ps_id, names, handle)
    return handle


def allgather_async(array: np.ndarray, alloc: Alloc, name=None, process_set=global_process_set,
                    priority: int = 0, dtype: Optional[DType] = None,
                    finish: Callable[[list], Any] = lambda r: r[0]) -> int:
    """Start an allgather: concatenate every rank's ``array`` along the first dimension."""
    return grouped_allgather_async([array], [alloc], name, process_set, priority, [dtype], finish, _single=True)


def grouped_allgather_async(arrays, allocs, name=None, process_set=global_process_set, priority: int = 0,
                            dtypes=None, finish=lambda r: r, _single=False) -> int:
    ps_id, _, _ = _info(process_set)
    base = _name("allgather", name, ps_id)
    items, keep = [], []
    for i, arr in enumerate(arrays):
        dt = _dt(dtypes, i, arr, "allgather")
        shape = tuple(arr.shape) if arr.ndim else (1,)
        items.append(Request(name=base if _single else f"{base}.{i}", dtype=int(dt), shape=shape, input=arr,
                             priority=int(priority)))
    return runtime().engine.submit(ps_id, _ALLGATHER, items, _gathered(allocs, finish), arrays)


def root_index(root_rank, what: str = "broadcast") -> int:
    """``root_rank`` as an int (a Python or NumPy integer, or a 0-d integer tensor).

    Raises:
        TypeError: anything else (a float, None, a string), which int() would silently turn into a rank.
    """
    try:
        return operator.index(root_rank)
    except TypeError:
        raise TypeError(f"perseus.{what}: root_rank must be an int (a rank of the job), not "
                        f"{type(root_rank).__name__} {root_rank!r}") from None


def broadcast_async(array: np.ndarray, output: np.ndarray, root_rank: int, name=None,
                    process_set=global_process_set, priority: int = 0, dtype: Optional[DType] = None,
                    finish=lambda r: r[0]) -> int:
    """Start a broadcast of ``array`` from ``root_rank`` into ``output``.

    ``root_rank`` is a rank of the job (as in Horovod), and must belong to ``process_set``.
    """
    ps_id, size, _ = _info(process_set)
    root = root_in_set(root_rank, ps_id)
    dt = dtype if dtype is not None else _check(array, "broadcast")
    item = Request(name=_name("broadcast", name, ps_id), dtype=int(dt), shape=array.shape, input=array,
                   output=output, root_rank=root, priority=int(priority))
    return runtime().engine.submit(ps_id, _BROADCAST, [item], finish, (array, output))


def root_in_set(root_rank, ps_id: int) -> int:
    """A broadcast's ``root_rank`` (a job rank) as its index in process set ``ps_id``.

    Raises:
        TypeError: not an int (see :func:`root_index`). ValueError: not a rank of the set.
    """
    root_rank = root_index(root_rank)
    members = runtime().process_set_ranks(ps_id)
    if root_rank not in members:
        raise ValueError(f"perseus.broadcast: root_rank {root_rank} is not a rank of the process set "
                         f"(ranks {members}); pass the root's global rank")
    return members.index(root_rank)


def even_splits(first_dim: int, size: int, what: str = "alltoall") -> np.ndarray:
    if first_dim % size:
        raise ValueError(f"perseus.{what}: the first dimension ({first_dim}) must be divisible by the number of "
                         f"ranks ({size}) when splits are not given")
    return np.full(size, first_dim // size, np.int64)


def alltoall_splits(splits, rows: int, size: int) -> np.ndarray:
    """An alltoall's ``splits`` (None: even) checked and as int64: one non-negative count per rank of the set,
    summing to the first dimension ``rows``.

    Raises:
        BadArgumentTypeError (a TypeError and a ValueError, as Horovod raises): the splits are not integers.
        ValueError: the wrong number of counts, a negative count, or a sum other than ``rows``.
    """
    if splits is None:
        return even_splits(rows, size)
    raw = np.asarray(splits)
    if raw.dtype.kind not in "iu" and raw.size:
        raise BadArgumentTypeError(f"perseus.alltoall: splits must be integers (the rows for each rank), got "
                                   f"{raw.dtype} {raw.tolist()!r}")
    out = raw.astype(np.int64).reshape(-1)
    if out.size != size:
        raise ValueError(f"perseus.alltoall: splits has {out.size} entries but the process set has {size} "
                         "ranks; give one count per rank")
    if (out < 0).any() or int(out.sum()) != rows:
        raise ValueError(f"perseus.alltoall: splits {out.tolist()} must be non-negative and sum to the first "
                         f"dimension ({rows})")
    return out


def alltoall_async(array: np.ndarray, splits: Optional[np.ndarray], alloc: Alloc, name=None,
                   process_set=global_process_set, priority: int = 0, dtype: Optional[DType] = None,
                   finish=lambda r: r[0]) -> int:
    """Start an alltoall: rows ``splits[i]`` of ``array`` go to rank i; received rows are concatenated."""
    ps_id, size, _ = _info(process_set)
    dt = dtype if dtype is not None else _check(array, "alltoall")
    shape = tuple(array.shape) if array.ndim else (1,)
    splits = alltoall_splits(splits, shape[0], size)
    item = Request(name=_name("alltoall", name, ps_id), dtype=int(dt), shape=shape, input=array,
                   priority=int(priority), splits=splits.tolist())
    return runtime().engine.submit(ps_id, _ALLTOALL, [item], _gathered([alloc], finish), array)


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
    ps_id, size, rank = _info(process_set)
    pre, post = _factors(prescale_factor, postscale_factor, "reducescatter")
    base = _name("reducescatter", name, ps_id)
    items, outputs = [], []
    for i, (arr, alloc) in enumerate(zip(arrays, allocs)):
        dt = _dt(dtypes, i, arr, "reducescatter")
        if arr.ndim == 0:
            raise ValueError("perseus.reducescatter: the tensor needs at least one dimension to scatter")
        if dt is DType.BOOL and op == ReduceOp.AVERAGE:
            raise ValueError("perseus.reducescatter: op=Average is not defined for bool tensors; use Sum, Min or "
                             "Max")
        # The output size is known up front: rank r keeps its share of the first dimension.
        out = alloc((even_counts(arr.shape[0], size)[rank],) + tuple(arr.shape[1:]))
        outputs.append(out)
        items.append(Request(name=base if _single else f"{base}.{i}", dtype=int(dt), shape=arr.shape, input=arr,
                             output=out, reduce_op=int(op), prescale=pre, postscale=post,
                             priority=int(priority)))
    results = [Result(out, None) for out in outputs]
    return runtime().engine.submit(ps_id, _REDUCESCATTER, items, lambda _r: finish(results), (arrays, outputs))


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank of ``process_set`` has called barrier."""
    ps_id, _, _ = _info(process_set)
    with _barrier_lock:
        count = _barrier_counts.get(ps_id, 0) + 1
        _barrier_counts[ps_id] = count
    item = Request(name=f"barrier.{count}", dtype=DType.UINT8, shape=())
    synchronize(runtime().engine.submit(ps_id, _BARRIER, [item], None, None))


def join(process_set: ProcessSet = global_process_set) -> int:
    """Block until every rank has joined; meanwhile this rank contributes zeros to others' allreduces.

    Returns the rank that joined last.
    """
    ps_id, _, _ = _info(process_set)
    engine = runtime().engine
    return engine.wait(engine.join(ps_id))


def poll(handle: int) -> bool:
    """True when every request of ``handle`` has finished.

    Raises:
        ValueError: ``handle`` is unknown (already synchronized, or never issued).
    """
    return runtime().engine.poll(handle)


def synchronize(handle: int):
    """Wait for ``handle`` and return its result; None for an unknown handle (as Horovod does).

    Raises:
        PerseusInternalError: the collective failed on this or another rank (MismatchError, StallError).
    """
    return runtime().engine.wait(handle)


def on_done(handle_ids, callback) -> None:
    """Call ``callback()`` when every handle in ``handle_ids`` has finished (collect results with synchronize).

    The callback runs at once if they have, else on a perseus thread holding the GIL; it must be quick.
    """
    runtime().engine.on_done([int(h) for h in handle_ids], callback)
