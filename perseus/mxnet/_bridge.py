"""Bridge between MXNet NDArrays and perseus' NumPy-level collectives, and MXNet's error classes.

Memory: an NDArray is lent to the engine without a copy through DLPack. ``to_dlpack_for_read`` waits for
MXNet's pending writes to the array and ``to_dlpack_for_write`` for every pending read and write, so the
engine sees the value the Python program has asked for and MXNet does not touch the buffer while the engine
works on it (each perseus.mxnet call returns only after the engine has finished with its arrays). NumPy marks
arrays imported from DLPack read-only; for ``*_for_write`` capsules a writable alias of the same memory is
made, which keeps the DLPack tensor (and so MXNet's storage) alive. bool arrays, which MXNet 1.9 cannot export
through DLPack, and empty arrays are copied instead.

Outputs whose shape is known up front (allreduce, broadcast, reducescatter) are allocated as NDArrays and
filled in place; allgather and alltoall outputs, whose shape the engine learns from the peers, are received
into NumPy arrays and copied into a new NDArray.

Errors: a collective that fails raises an ``mxnet.base.MXNetError`` that is also a perseus error:
:class:`PerseusMXNetMismatchError` (also a ``MismatchError``) when ranks disagree about a tensor,
:class:`PerseusMXNetInternalError` (also a ``PerseusInternalError``) for a stall, failed peer or shut down
engine, and :class:`PerseusMXNetValueError` (also a ``ValueError``) for arguments rejected before anything
reached the engine.
"""

from __future__ import annotations

from typing import Callable, Optional

import mxnet as mx
import numpy as np
from mxnet.base import MXNetError

from perseus.runtime import collectives as _c
from perseus.runtime.state import runtime
from perseus.base.exceptions import MismatchError, PerseusInternalError
from perseus.engine.messages import DType

__all__ = [
    "PerseusMXNetInternalError", "PerseusMXNetMismatchError", "PerseusMXNetValueError", "engine_dtype",
    "check_ndarray", "read_view", "WriteTarget", "Output", "Pending", "ps_info",
]

_DTYPES = {
    np.dtype(np.uint8): DType.UINT8, np.dtype(np.int8): DType.INT8, np.dtype(np.int32): DType.INT32,
    np.dtype(np.int64): DType.INT64, np.dtype(np.float16): DType.FLOAT16, np.dtype(np.float32): DType.FLOAT32,
    np.dtype(np.float64): DType.FLOAT64, np.dtype(np.bool_): DType.BOOL,
}
# The dtypes MXNet 1.9 exports through DLPack; bool travels as a copy. NumPy < 1.22 cannot import DLPack
# (1.22 names the function _from_dlpack): then every dtype travels as a copy.
_from_dlpack = getattr(np, "from_dlpack", None) or getattr(np, "_from_dlpack", None)
_DLPACK = set(_DTYPES) - {np.dtype(np.bool_)} if _from_dlpack is not None else set()
_CPU = ("cpu", "cpu_pinned", "cpu_shared")


class PerseusMXNetInternalError(MXNetError, PerseusInternalError):
    """A collective failed (stall, failed or shut-down peer, transport error): an MXNetError and a
    HorovodInternalError."""


class PerseusMXNetMismatchError(MXNetError, MismatchError):
    """Ranks disagreed about a collective (shape, dtype, op, root rank, scale factors). Raised on every rank."""


class PerseusMXNetValueError(MXNetError, ValueError):
    """A collective's arguments were rejected on this rank before anything was sent (bad splits, a scalar
    for reducescatter, a process set this rank is not in, ...): an MXNetError and a ValueError."""


def _message(exc: BaseException, what: str) -> str:
    """The perseus message as it is when it already names the call, else prefixed with it."""
    text = str(exc)
    return text if text.startswith("perseus") else f"perseus.mxnet.{what}: {text}"


def mx_error(exc: PerseusInternalError, what: str) -> MXNetError:
    cls = PerseusMXNetMismatchError if isinstance(exc, MismatchError) else PerseusMXNetInternalError
    return cls(_message(exc, what))


def engine_dtype(nd) -> DType:
    """The engine dtype of an NDArray; ValueError for a dtype perseus does not move."""
    try:
        return _DTYPES[np.dtype(nd.dtype)]
    except (KeyError, TypeError):
        raise PerseusMXNetValueError(
            f"perseus.mxnet: NDArray dtype {nd.dtype} is not supported; use one of "
            f"{', '.join(sorted(d.name for d in _DTYPES))}") from None


def check_ndarray(nd, what: str) -> DType:
    """Validate one input: a dense CPU NDArray of a supported dtype. Returns its engine dtype.

    Raises:
        TypeError: not an NDArray.
        PerseusMXNetValueError: a sparse NDArray or an unsupported dtype.
        NotImplementedError: the NDArray lives on a GPU.
    """
    if not isinstance(nd, mx.nd.NDArray):
        raise TypeError(f"perseus.mxnet.{what}: expected an mxnet.nd.NDArray, got {type(nd).__name__}")
    if nd.stype != "default":
        raise PerseusMXNetValueError(f"perseus.mxnet.{what}: {nd.stype} NDArrays are not supported; convert "
                                     "with .tostype('default')")
    if nd.context.device_type not in _CPU:
        raise NotImplementedError(f"perseus.mxnet.{what}: NDArrays on {nd.context} need the GPU (NCCL) "
                                  "transport, which is not implemented yet; use CPU contexts")
    return engine_dtype(nd)


class _DLPackCapsule:
    """What ``np.from_dlpack`` needs around a raw capsule from ``NDArray.to_dlpack_for_*``."""

    __slots__ = ("_capsule",)

    def __init__(self, capsule):
        self._capsule = capsule

    def __dlpack__(self, stream=None):
        return self._capsule

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU


class _Writable:
    """A writable ``__array_interface__`` over a read-only array imported from a write capsule; holding the
    imported array keeps the DLPack tensor, and so MXNet's storage, alive."""

    __slots__ = ("__array_interface__", "_owner")

    def __init__(self, owner: np.ndarray):
        iface = dict(owner.__array_interface__)
        iface["data"] = (iface["data"][0], False)
        self.__array_interface__ = iface
        self._owner = owner


def _zero_copy(nd) -> bool:
    return np.dtype(nd.dtype) in _DLPACK and nd.size > 0


def read_view(nd) -> np.ndarray:
    """A C-contiguous NumPy array with the NDArray's values, once MXNet's pending writes to it are done:
    the NDArray's own memory where possible, else a copy."""
    if _zero_copy(nd):
        return _from_dlpack(_DLPackCapsule(nd.to_dlpack_for_read()))
    if nd.size == 0:
        return np.empty(nd.shape, np.dtype(nd.dtype))
    return np.ascontiguousarray(nd.asnumpy())


def _write_view(nd) -> np.ndarray:
    owner = _from_dlpack(_DLPackCapsule(nd.to_dlpack_for_write()))
    return np.asarray(_Writable(owner))


class WriteTarget:
    """An NDArray the engine writes into: ``array`` is its memory (or a staging copy, written back by
    :meth:`commit`)."""

    __slots__ = ("nd", "array", "_copy")

    def __init__(self, nd, initialise: bool = True):
        self.nd = nd
        self._copy = not _zero_copy(nd)
        if not self._copy:
            self.array = _write_view(nd)
        elif initialise and nd.size:
            self.array = np.ascontiguousarray(nd.asnumpy())
        else:
            self.array = np.empty(nd.shape, np.dtype(nd.dtype))

    def commit(self):
        if self._copy and self.nd.size:
            self.nd[:] = self.array if self.array.ndim else self.array.reshape(1)
        return self.nd


class Output:
    """Where one request's result lands. With ``shape`` the NDArray is allocated now and filled in place;
    without, the engine's array is copied into a new NDArray by :meth:`result`."""

    __slots__ = ("ctx", "dtype", "target", "received")

    def __init__(self, like, shape: Optional[tuple] = None):
        self.ctx, self.dtype = like.context, np.dtype(like.dtype)
        self.target = None
        if shape is not None and all(shape):
            self.target = WriteTarget(mx.nd.empty(shape, ctx=self.ctx, dtype=self.dtype), initialise=False)
        self.received: Optional[np.ndarray] = None

    def alloc(self, shape) -> np.ndarray:
        """Called by the engine with the output shape."""
        if self.target is not None and tuple(shape) == tuple(self.target.nd.shape):
            return self.target.array
        self.target = None
        return np.empty(shape, self.dtype)

    def result(self, entry):
        if self.target is not None:
            return self.target.commit()
        return mx.nd.array(entry.output, ctx=self.ctx, dtype=self.dtype)


def ps_info(process_set):
    """``(id, size, rank_in_set)``; PerseusMXNetValueError when the set is unusable on this rank."""
    try:
        return runtime().process_set_info(process_set)
    except ValueError as exc:
        raise PerseusMXNetValueError(str(exc)) from None


class Pending:
    """A submitted request: :meth:`wait` blocks until the engine is done and returns the result."""

    __slots__ = ("handle", "what")

    def __init__(self, what: str, submit: Callable[[], int]):
        self.what = what
        try:
            self.handle = submit()
        except PerseusMXNetValueError:
            raise
        except ValueError as exc:
            raise PerseusMXNetValueError(_message(exc, what)) from None
        except PerseusInternalError as exc:
            raise mx_error(exc, what) from None

    def wait(self):
        try:
            return _c.synchronize(self.handle)
        except PerseusInternalError as exc:
            if isinstance(exc, MXNetError):
                raise
            raise mx_error(exc, self.what) from None
