"""The nouns of the engine pipeline: dtypes, op types, signatures, entries and handles.

An :class:`Entry` is one request from a framework adapter: a named tensor (as a flat NumPy view of the
framework's memory) and what to do with it. A :class:`Signature` is the part of an entry that every rank must
agree on; negotiation compares signatures across ranks and caches them by tensor index.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import threading
import time
from typing import Any, Callable, Optional

import numpy as np

from perseus.common.reduce_ops import ReduceOp

__all__ = ["DType", "OpType", "Signature", "Entry", "Handle", "numpy_dtype", "dtype_of", "make_signature"]


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

    @property
    def prefix(self) -> str:
        return self.name.lower()


@dataclasses.dataclass(frozen=True, slots=True)
class Signature:
    """What every rank must agree on for one tensor name.

    ``shape`` excludes the first dimension for allgather and alltoall, where it may differ per rank.
    """

    op_type: OpType
    dtype: DType
    shape: tuple[int, ...]
    reduce_op: int = int(ReduceOp.SUM)
    root_rank: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    priority: int = 0

    def describe_difference(self, other: "Signature") -> Optional[tuple[str, str, str]]:
        """Return ``(field, mine, theirs)`` for the first field in which ``other`` differs, else None."""
        for field in dataclasses.fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if mine != theirs:
                return field.name, _show(field.name, mine), _show(field.name, theirs)
        return None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _show(field: str, value: Any) -> str:
    if field == "dtype":
        return DType(value).name.lower()
    if field == "op_type":
        return OpType(value).name.lower()
    if field == "reduce_op":
        return ReduceOp(value).name.title()
    return repr(value)


@functools.lru_cache(maxsize=65536)
def make_signature(op_type: "OpType", dtype: "DType", shape: tuple, reduce_op: int = 1, root_rank: int = -1,
                   prescale: float = 1.0, postscale: float = 1.0, priority: int = 0) -> "Signature":
    """Return the (shared, immutable) Signature with these fields; cached, since every step repeats them."""
    return Signature(op_type, dtype, shape, reduce_op, root_rank, prescale, postscale, priority)


class Handle:
    """Completion of one request. The engine sets the result or the error exactly once.

    Waiting uses a lock that is held until completion: much cheaper to create than an Event, which
    matters because every request makes one.
    """

    __slots__ = ("_gate", "_finished", "result", "error", "callbacks")

    def __init__(self):
        self._gate = threading.Lock()
        self._gate.acquire()
        self._finished = False
        self.result: Any = None
        self.error: Optional[BaseException] = None
        self.callbacks: Optional[list[Callable[["Handle"], None]]] = None

    def done(self) -> bool:
        return self._finished

    def set_result(self, result: Any) -> None:
        self._finish(result, None)

    def set_error(self, error: BaseException) -> None:
        self._finish(None, error)

    def _finish(self, result: Any, error: Optional[BaseException]) -> None:
        with _FINISH_LOCK:
            if self._finished:
                return
            self.result, self.error = result, error
            self._finished = True
            callbacks, self.callbacks = self.callbacks, None
        self._gate.release()
        for cb in callbacks or ():
            cb(self)

    def add_callback(self, callback: Callable[["Handle"], None]) -> None:
        """Call ``callback(handle)`` on completion (at once if already complete), on the completing thread."""
        with _FINISH_LOCK:
            if not self._finished:
                if self.callbacks is None:
                    self.callbacks = []
                self.callbacks.append(callback)
                return
        callback(self)

    def wait(self, timeout_s: Optional[float] = None) -> Any:
        """Block until done; return the result or raise the error (``TimeoutError`` after ``timeout_s``)."""
        if not self._finished:
            if not self._gate.acquire(True, -1 if timeout_s is None else timeout_s):
                raise TimeoutError(f"perseus request not completed within {timeout_s} s")
            self._gate.release()
        if self.error is not None:
            raise self.error
        return self.result


_FINISH_LOCK = threading.Lock()


@dataclasses.dataclass(slots=True, eq=False)
class Entry:
    """One request: a named tensor, what to do with it, and where the result goes.

    ``input`` is a C-contiguous NumPy view of the framework tensor (flat or shaped). ``output`` is a
    preallocated view for ops whose output shape is known up front (allreduce, broadcast); otherwise
    ``alloc`` is called with the output shape once it is known and must return a writable C-contiguous array.
    """

    name: str
    signature: Signature
    shape: tuple[int, ...]
    input: Optional[np.ndarray]
    output: Optional[np.ndarray] = None
    alloc: Optional[Callable[[tuple[int, ...]], np.ndarray]] = None
    splits: Optional[np.ndarray] = None
    process_set_id: int = 0
    handle: Handle = dataclasses.field(default_factory=Handle)
    submit_time: float = dataclasses.field(default_factory=time.monotonic)
    remaining: int = 0  # units still to finish (set by fusion)
    received_splits: Optional[np.ndarray] = None
    phantom: bool = False  # stands in for a tensor this (joined) rank did not submit

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.signature.dtype.itemsize * self.numel


