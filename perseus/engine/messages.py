"""What crosses into the native core: element types, collective kinds, and the request record.

Requests themselves (name, signature, buffers) live in the native core (``native/handles.h``); adapters
describe each tensor of a submission with one :class:`Request` (see :mod:`perseus.runtime.collectives`).
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple, Optional

import numpy as np

__all__ = ["DType", "OpType", "Request", "Timing", "numpy_dtype", "dtype_of"]


class DType(enum.IntEnum):
    """Element types the engine moves. bfloat16 travels as raw 16-bit words."""

    UINT8 = 0
    INT8 = 1
    INT16 = 2
    INT32 = 3
    INT64 = 4
    FLOAT16 = 5
    BFLOAT16 = 6
    FLOAT32 = 7
    FLOAT64 = 8
    BOOL = 9
    UINT16 = 10

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]


_NUMPY = {
    DType.UINT8: np.dtype(np.uint8), DType.INT8: np.dtype(np.int8), DType.INT16: np.dtype(np.int16),
    DType.INT32: np.dtype(np.int32), DType.INT64: np.dtype(np.int64), DType.FLOAT16: np.dtype(np.float16),
    DType.BFLOAT16: np.dtype(np.uint16), DType.FLOAT32: np.dtype(np.float32),
    DType.FLOAT64: np.dtype(np.float64), DType.BOOL: np.dtype(np.bool_), DType.UINT16: np.dtype(np.uint16),
}
_ITEMSIZE = {d: n.itemsize for d, n in _NUMPY.items()}
_FROM_NUMPY = {v: k for k, v in _NUMPY.items() if k is not DType.BFLOAT16}


def numpy_dtype(dtype: DType) -> np.dtype:
    """NumPy dtype used to hold ``dtype`` (bfloat16 is held as uint16 words)."""
    return _NUMPY[dtype]


def dtype_of(array: np.ndarray) -> DType:
    """Engine dtype of a NumPy array; raise ``ValueError`` for unsupported dtypes."""
    try:
        return _FROM_NUMPY[array.dtype]
    except KeyError:
        raise ValueError(f"Tensor type {array.dtype} is not supported.") from None


class Timing(enum.IntEnum):
    """How the run-time tuner's step timer counts a request (``native/step_timer.h``)."""

    NONE = 0      # in no training step: the tuner's own collectives, which come at irregular times
    UNSIGNED = 1  # in the step's time and bytes, not in its digest: collectives whose shapes vary by step
    FULL = 2      # in the step and in its digest (what a training loop submits)


class Request(NamedTuple):
    """One tensor of a submission to ``Engine.submit``. The native core reads the fields in this order
    (``native/python_requests.cc``, ``add_request``); build it with keywords. A request is collective: every rank of the
    process set submits one with the same name, dtype, shape (first dimension excepted for allgather and
    alltoall), reduce_op, root_rank, scales and priority.
    """

    name: str
    dtype: int                      # a DType
    shape: tuple                    # the full shape (allgather/alltoall: this rank's first dimension)
    input: Any = None               # NumPy array or raw address; None: in place on output (or no data)
    output: Any = None              # None for allgather/alltoall: the engine allocates the result
    reduce_op: int = 1              # a perseus.base.reduce_ops.ReduceOp (Sum)
    root_rank: int = -1             # broadcast: the root's rank within the process set
    prescale: float = 1.0
    postscale: float = 1.0
    priority: int = 0
    splits: Optional[list] = None   # alltoall: rows sent to each rank
    timing: int = Timing.FULL       # a Timing: how the step timer counts it (the caller's own, not collective)


class OpType(enum.IntEnum):
    ALLREDUCE = 0
    ALLGATHER = 1
    BROADCAST = 2
    ALLTOALL = 3
    REDUCESCATTER = 4
    BARRIER = 5
    TUNE = 6

    @property
    def prefix(self) -> str:
        return self.name.lower()
