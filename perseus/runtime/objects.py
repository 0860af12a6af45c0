"""Move arbitrary picklable Python objects between ranks (broadcast_object, allgather_object).

Framework-neutral: the objects are serialised with cloudpickle and travel as uint8 NumPy arrays through the
engine's collectives, so the functions work the same from every adapter and in any TensorFlow mode.
"""

from __future__ import annotations

import cloudpickle
import numpy as np

from perseus.runtime import collectives as _c
from perseus.runtime.state import runtime
from perseus.runtime.process_sets import global_process_set

__all__ = ["broadcast_object", "allgather_object"]


def _gather(array: np.ndarray, name: str, process_set) -> np.ndarray:
    holder = []

    def alloc(shape):
        holder.append(np.empty(shape, array.dtype))
        return holder[0]
    return _c.synchronize(_c.allgather_async(array, alloc, name, process_set, finish=lambda r: holder[0]))


def _broadcast(array: np.ndarray, root_rank: int, name: str, process_set) -> np.ndarray:
    out = np.empty_like(array)
    return _c.synchronize(_c.broadcast_async(array, out, root_rank, name, process_set, finish=lambda r: out))


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Return job rank ``root_rank``'s ``obj`` on every rank of ``process_set``.

    Collective: every rank of the set calls it with the same ``name``; only the root's ``obj`` matters.
    Raises ValueError if this rank is not in ``process_set``.
    """
    name = name or type(obj).__name__
    root_rank = _c.root_index(root_rank, "broadcast_object")
    if runtime().rank() == root_rank:
        payload = np.frombuffer(cloudpickle.dumps(obj), np.uint8).copy()
        length = np.array([payload.size], np.int64)
    else:
        payload, length = None, np.zeros(1, np.int64)
    length = _broadcast(length, root_rank, f"{name}.sz", process_set)
    if payload is None:
        payload = np.empty(int(length[0]), np.uint8)
    data = _broadcast(payload, root_rank, f"{name}.t", process_set)
    if runtime().rank() == root_rank:
        return obj
    return cloudpickle.loads(data.tobytes())


def allgather_object(obj, name=None, process_set=global_process_set):
    """Return the list of every rank's ``obj`` (the ranks of ``process_set``, in order).

    Collective: every rank of the set calls it with the same ``name``.
    """
    name = name or type(obj).__name__
    data = np.frombuffer(cloudpickle.dumps(obj), np.uint8).copy()
    sizes = _gather(np.array([data.size], np.int64), f"{name}.sz", process_set)
    gathered = _gather(data, f"{name}.t", process_set).tobytes()
    out, offset = [], 0
    for n in sizes.tolist():
        out.append(cloudpickle.loads(gathered[offset:offset + n]))
        offset += n
    return out
