"""The engine's element types and collective kinds, numbered as the native core numbers them.

Requests themselves (name, signature, buffers) live in the native core (``native/handles.h``); adapters pass
them as tuples of these integers and buffers (see :mod:`perseus.common.collectives`).
"""

from __future__ import annotations

import enum

import numpy as np

__all__ = ["DType", "OpType", "numpy_dtype", "dtype_of"]


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
