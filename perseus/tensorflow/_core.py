"""Bridge between TensorFlow tensors and perseus' NumPy-level collectives, eagerly and inside graphs.

Eager mode: the tensor's buffer is read with ``.numpy()`` (bfloat16 through ``tf.bitcast`` to uint16), the
collective runs at once and the result is wrapped with ``tf.convert_to_tensor``.

Graph mode (inside ``tf.function`` or a TF1 graph): each collective is an enqueue op that hands the request
to the engine and returns at once, and a wait op (see :func:`run` for why no TF thread ends up waiting on a
peer that cannot submit). A
collective that fails because ranks disagree (shape, dtype, op, root) makes the py_function return a failure
status, and a guard op then raises ``tf.errors.FailedPreconditionError`` (the full message is logged by the
``perseus`` logger, since the graph error can only carry a fixed text). Other failures (stall, failed peer,
shut down) surface as ``tf.errors.UnknownError``. XLA (``tf.function(jit_compile=True)``) cannot compile
py_function: perseus raises ``NotImplementedError`` at trace time naming the fix.

Names: eagerly, unnamed requests are numbered by the collectives layer (ranks must call them in the same
order). In a graph, an unnamed request is named at trace time after its input tensor, as Horovod does
(``HorovodAllreduce_<tensor name>``), prefixed by the current name scope unless ``ignore_name_scope``, and made
unique within the graph.
"""

from __future__ import annotations

import itertools
import logging
import re
import weakref

import numpy as np
import tensorflow as tf

from perseus.runtime import collectives as _c
from perseus.runtime.state import runtime
from perseus.base.exceptions import MismatchError, NotAMemberError, PerseusInternalError
from perseus.engine.messages import DType
from perseus.tensorflow import _await

__all__ = ["PerseusFailedPreconditionError", "PerseusInvalidArgumentError", "PerseusUnknownError", "engine_dtype", "to_numpy", "from_numpy",
           "run", "op_name", "ps_info", "Pending"]

_log = logging.getLogger("perseus")

_DTYPES = {
    tf.uint8: DType.UINT8, tf.int8: DType.INT8, tf.int16: DType.INT16, tf.int32: DType.INT32,
    tf.int64: DType.INT64, tf.float16: DType.FLOAT16, tf.bfloat16: DType.BFLOAT16, tf.float32: DType.FLOAT32,
    tf.float64: DType.FLOAT64, tf.bool: DType.BOOL, tf.uint16: DType.UINT16,
}


class PerseusFailedPreconditionError(tf.errors.FailedPreconditionError, PerseusInternalError):
    """Ranks disagreed about a collective (eager mode). Both a TF error and a HorovodInternalError."""

    def __init__(self, message):
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)


class PerseusInvalidArgumentError(tf.errors.InvalidArgumentError, ValueError):
    """A collective's arguments are invalid on this rank (eager mode); also a ValueError."""

    def __init__(self, message):
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)


class PerseusUnknownError(tf.errors.UnknownError, PerseusInternalError):
    """A collective failed for another reason: stall, failed peer, shut down (eager mode)."""

    def __init__(self, message):
        tf.errors.UnknownError.__init__(self, None, None, message)


def _is_mismatch(exc: BaseException) -> bool:
    return isinstance(exc, MismatchError)


def _tf_error(exc: PerseusInternalError, what: str):
    message = f"{what}: {exc}"
    return PerseusFailedPreconditionError(message) if _is_mismatch(exc) else PerseusUnknownError(message)


def engine_dtype(tensor) -> DType:
    """The engine dtype of a tensor; ValueError for dtypes perseus does not move."""
    try:
        return _DTYPES[tensor.dtype]
    except KeyError:
        raise ValueError(f"perseus: tensor type {tensor.dtype.name} is not supported; use one of "
                         f"{', '.join(sorted(d.name for d in _DTYPES))}") from None


def to_numpy(tensor) -> np.ndarray:
    """A C-contiguous NumPy array holding an eager tensor's values (bfloat16 as uint16 words)."""
    if tensor.dtype == tf.bfloat16:
        tensor = tf.bitcast(tensor, tf.uint16)
    array = np.asarray(tensor.numpy())
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


def from_numpy(array: np.ndarray, dtype) -> tf.Tensor:
    """An eager tensor of ``dtype`` from a NumPy array produced by :func:`to_numpy`'s convention."""
    if dtype == tf.bfloat16:
        return tf.bitcast(tf.convert_to_tensor(np.asarray(array, np.uint16)), tf.bfloat16)
    return tf.convert_to_tensor(array, dtype=dtype)


def ps_info(process_set):
    """``(id, size, rank_in_set)`` of a process set this rank belongs to.

    Raises:
        ValueError: perseus is not initialised, or the set is not registered.
        tf.errors.InvalidArgumentError: this rank is not a member of the set (as Horovod's TensorFlow ops).
    """
    try:
        return runtime().process_set_info(process_set)
    except NotAMemberError as exc:
        raise tf.errors.InvalidArgumentError(None, None, str(exc)) from None


def _check_no_xla() -> None:
    from tensorflow.python.framework import ops
    from tensorflow.python.ops import control_flow_util

    if control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph()):
        raise NotImplementedError(
            "perseus.tensorflow collectives cannot be compiled by XLA: they run through tf.py_function. Remove "
            "jit_compile=True from the tf.function that calls them (or compile only the model's computation "
            "and call the collective outside it)")


_graph_names: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _normalize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _tensor_label(tensor, graph):
    """The normalised name of ``tensor``, or None when it is a capture of an outside tensor."""
    if any(tensor is c for c in getattr(graph, "internal_captures", ())):
        return None
    return _normalize(tensor.name)


def op_name(kind: str, name, tensors, ignore_name_scope: bool = False):
    """The request name: ``name`` itself eagerly; in a graph a deterministic, graph-unique name."""
    if tf.executing_eagerly():
        return name
    graph = tf.compat.v1.get_default_graph()
    if name is None:
        labels = [_tensor_label(t, graph) for t in (tensors[:1] if len(tensors) == 1 else [tensors[0], tensors[-1]])]
        # A tensor captured from outside a tf.function is named after a global counter that differs between
        # ranks: such requests are numbered within the graph instead.
        name = f"{kind}_captured" if None in labels else "_".join([kind] + labels)
    if not ignore_name_scope:
        scope = tf.get_current_name_scope()
        if scope:
            name = f"{scope}/{name}"
    used = _graph_names.setdefault(graph, {})
    n = used.get(name, 0)
    used[name] = n + 1
    return name if n == 0 else f"{name}_{n}"


def _guard(outputs, status, what: str):
    """Outputs that raise FailedPreconditionError when ``status`` is non-zero."""
    shared = f"perseus_collective_failed: {what} (ranks disagree about shape, dtype, op or root; the full " \
             "message is in the perseus log)"

    def fail():
        handle = tf.raw_ops.VarHandleOp(dtype=tf.int32, shape=[], shared_name=shared)
        return tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.int32)

    check = tf.cond(status > 0, fail, lambda: tf.constant(0, tf.int32))
    with tf.control_dependencies([check]):
        return [tf.identity(o) for o in outputs]


class Pending:
    """Submitted requests (handle-table ids) and how to turn their results into the op's outputs."""

    __slots__ = ("handles", "combine")

    def __init__(self, handles, combine=None):
        self.handles = list(handles)
        self.combine = combine if combine is not None else (lambda results: results[0])

    def on_done(self, callback):
        """Call ``callback()`` once every request has finished."""
        _c.on_done(self.handles, callback)

    def wait(self):
        return self.combine([_c.synchronize(h) for h in self.handles])


class _Failed:
    """A submission that failed at once: done, and raises on wait."""

    def __init__(self, exc):
        self.exc = exc

    def on_done(self, callback):
        callback()

    def wait(self):
        raise self.exc


_pending: dict = {}
_next_id = itertools.count(1)


def run(fn, inputs, out_dtypes, what: str):
    """Run a collective on ``inputs``; return tensors of ``out_dtypes``.

    ``fn(list of arrays)`` submits the request and returns a :class:`Pending`. Eagerly it is waited for at
    once. In a graph the collective is three ops: an enqueue op (a py_function that submits and outputs a
    request key at once), the asynchronous PerseusAwait op (:mod:`perseus.tensorflow._await`), which completes
    when the engine has finished without holding a TensorFlow thread meanwhile, and a finish op (a
    py_function that collects the result). Since no thread waits, TensorFlow can always run the enqueue ops
    the peers are waiting for, in any order, in tf.function and in TF1 sessions alike. Without the await op
    (it could not be built) the finish op blocks instead; inside tf.function that is still safe (automatic
    control dependencies run the stateful ops in program order on every rank), in a TF1 session with more
    concurrent collectives than inter-op threads it can stall.
    """
    if tf.executing_eagerly():
        arrays = [to_numpy(t) for t in inputs]
        try:
            pending = fn(arrays)
        except ValueError as exc:
            # As in a graph, where TF turns a py_function's ValueError into InvalidArgumentError.
            raise PerseusInvalidArgumentError(f"{what}: {exc}") from None
        try:
            outs = pending.wait()
        except PerseusInternalError as exc:
            if isinstance(exc, tf.errors.OpError):
                raise
            raise _tf_error(exc, what) from None
        return [from_numpy(o, d) for o, d in zip(outs, out_dtypes)]
    _check_no_xla()
    label = _normalize(what)[:200]
    awaiter = _await.load()

    def enqueue(*tensors):
        arrays = [to_numpy(t) for t in tensors]
        key = next(_next_id)
        try:
            pending = fn(arrays)
        except PerseusInternalError as exc:
            pending = _Failed(exc)
        # The eager input tensors are kept until the finish op: they own the buffers the engine reads.
        _pending[key] = (pending, tensors)
        if awaiter is not None:
            pending.on_done(lambda: awaiter[1](key))
        return tf.constant(key, tf.int64)

    def finish(key):
        pending, _inputs = _pending.pop(int(key.numpy()))
        try:
            outs = pending.wait()
        except PerseusInternalError as exc:
            if not _is_mismatch(exc):
                raise RuntimeError(f"{what}: {exc}") from None
            _log.error("%s: %s", what, exc)
            return [tf.zeros([0], d) for d in out_dtypes] + [tf.constant(1, tf.int32)]
        return [from_numpy(o, d) for o, d in zip(outs, out_dtypes)] + [tf.constant(0, tf.int32)]

    key = tf.py_function(enqueue, list(inputs), tf.int64, name=f"{label}_enqueue")
    if awaiter is not None:
        key = awaiter[0].perseus_await(key, name=f"{label}_await")
    results = tf.py_function(finish, [key], list(out_dtypes) + [tf.int32], name=label)
    return _guard(results[:-1], results[-1], what)
