"""Eager reductions of array-like values through perseus' NumPy-level collectives (the module-level
allreduce/allgather/broadcast of perseus.*.keras, the callbacks and the elastic state)."""

from __future__ import annotations

import numpy as np

from perseus.runtime import collectives as _c
from perseus.runtime.process_sets import global_process_set
from perseus.base.reduce_ops import Average

__all__ = ["broadcast_values", "allreduce_value", "allgather_value", "broadcast_value", "reducescatter_value"]


def _as_array(value) -> np.ndarray:
    if hasattr(value, "numpy"):
        value = value.numpy()
    array = np.asarray(value)
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


def broadcast_values(values, root_rank, name, process_set=global_process_set):
    """Broadcast a list of arrays/tensors/variables from job rank ``root_rank``; returns NumPy arrays.

    Collective: every rank of ``process_set`` passes values of the same shapes and dtypes in the same order.
    """
    arrays = [_as_array(v) for v in values]
    outs = [np.empty_like(a) for a in arrays]
    handles = [_c.broadcast_async(a, o, int(root_rank), f"{name}.{i}", process_set, finish=lambda r: None)
               for i, (a, o) in enumerate(zip(arrays, outs))]
    for h in handles:
        _c.synchronize(h)
    return outs


def allreduce_value(value, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set):
    """Reduce one array-like value across the ranks now; returns a NumPy array."""
    array = _as_array(value)
    out = np.empty_like(array)
    return _c.synchronize(_c.allreduce_async(array, out, name, op, prescale_factor, postscale_factor, process_set,
                                             finish=lambda r: out))


def allgather_value(value, name=None, process_set=global_process_set):
    """Concatenate one array-like value from every rank along the first dimension; returns a NumPy array."""
    array = _as_array(value)
    holder = []

    def alloc(shape):
        holder.append(np.empty(shape, array.dtype))
        return holder[0]
    return _c.synchronize(_c.allgather_async(array, alloc, name, process_set, finish=lambda r: holder[0]))


def broadcast_value(value, root_rank, name=None, process_set=global_process_set):
    """Return job rank ``root_rank``'s value of an array-like; a NumPy array."""
    array = _as_array(value)
    out = np.empty_like(array)
    return _c.synchronize(_c.broadcast_async(array, out, int(root_rank), name, process_set, finish=lambda r: out))


def reducescatter_value(value, name=None, op=Average, process_set=global_process_set):
    """Reduce one array-like value and return this rank's share of the first dimension; a NumPy array."""
    array = _as_array(value)
    holder = []

    def alloc(shape):
        holder.append(np.empty(shape, array.dtype))
        return holder[0]
    return _c.synchronize(_c.reducescatter_async(array, alloc, name, op, process_set,
                                                 finish=lambda r: holder[0]))
