"""Bridge between TensorFlow tensors and perseus' NumPy-level collectives, eagerly and inside graphs.

Eager mode: the tensor's buffer is read with ``.numpy()`` (bfloat16 through ``tf.bitcast`` to uint16), the
collective runs at once and the result is wrapped with ``tf.convert_to_tensor``.

Graph mode (inside ``tf.function`` or a TF1 graph): each collective is two ``tf.py_function`` ops, an
enqueue op that hands the request to the engine and returns at once, and a wait op that blocks until the
result is there (see :func:`run`). Enqueue ops run in the same order on every rank (program order in
tf.function, creation order in a TF1 graph), so no TF thread waits on a peer that cannot submit. A
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

from perseus.common.basics import state
from perseus.common.exceptions import MismatchError, PerseusInternalError
from perseus.engine.messages import DType

__all__ = ["PerseusFailedPreconditionError", "PerseusInvalidArgumentError", "PerseusUnknownError", "engine_dtype", "to_numpy", "from_numpy",
           "run", "op_name", "ps_info"]

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
    """``(id, size, rank_in_set)``; ValueError when not registered or this rank is not a member."""
    return state().process_set_info(process_set)


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


def op_name(kind: str, name, tensors, ignore_name_scope: bool = False):
    """The request name: ``name`` itself eagerly; in a graph a deterministic, graph-unique name."""
    if tf.executing_eagerly():
        return name
    if name is None:
        first, last = tensors[0].name, tensors[-1].name
        name = f"{kind}_{_normalize(first)}" if len(tensors) == 1 else f"{kind}_{_normalize(first)}_{_normalize(last)}"
    if not ignore_name_scope:
        scope = tf.get_current_name_scope()
        if scope:
            name = f"{scope}/{name}"
    graph = tf.compat.v1.get_default_graph()
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


_pending: dict = {}
_next_id = itertools.count(1)
_last_enqueue: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _chain(graph):
    """Control inputs that order this enqueue op after the previous one of the same TF1 graph.

    Inside tf.function, automatic control dependencies already run stateful ops in program order. A TF1
    graph has no such ordering: ranks could start different collectives first and every inter-op thread
    could end up waiting, so perseus orders its enqueue ops by creation (identical on every rank). Only the
    enqueues are ordered; the waits float, so collectives still fuse and overlap.
    """
    if getattr(graph, "building_function", False):
        return []
    last = _last_enqueue.get(graph)
    if last is None:
        return []
    context = graph._get_control_flow_context()  # noqa: SLF001 - ops in different frames cannot be chained
    return [last] if last._get_control_flow_context() is context else []  # noqa: SLF001


def run(fn, inputs, out_dtypes, what: str):
    """Run a collective on ``inputs``; return tensors of ``out_dtypes``.

    ``fn(list of arrays)`` submits the request and returns ``wait() -> list of arrays``. Eagerly both happen
    now. In a graph they become two py_function ops: an enqueue op that submits and returns a request id at
    once, and a wait op that blocks until the result is there, so a blocked TF thread never holds up the
    submission of the other collectives the peers are waiting for (see :func:`_chain`).
    """
    if tf.executing_eagerly():
        arrays = [to_numpy(t) for t in inputs]
        try:
            wait = fn(arrays)
        except ValueError as exc:
            # As in a graph, where TF turns a py_function's ValueError into InvalidArgumentError.
            raise PerseusInvalidArgumentError(f"{what}: {exc}") from None
        try:
            outs = wait()
        except PerseusInternalError as exc:
            if isinstance(exc, tf.errors.OpError):
                raise
            raise _tf_error(exc, what) from None
        return [from_numpy(o, d) for o, d in zip(outs, out_dtypes)]
    _check_no_xla()
    label = _normalize(what)[:200]

    def enqueue(*tensors):
        arrays = [to_numpy(t) for t in tensors]
        key = next(_next_id)
        try:
            wait = fn(arrays)
        except PerseusInternalError as exc:
            wait = _raiser(exc)
        # The eager input tensors are kept until the wait: they own the buffers the engine reads.
        _pending[key] = (wait, tensors)
        return tf.constant(key, tf.int64)

    def finish(key):
        wait, _inputs = _pending.pop(int(key.numpy()))
        try:
            outs = wait()
        except PerseusInternalError as exc:
            if not _is_mismatch(exc):
                raise RuntimeError(f"{what}: {exc}") from None
            _log.error("%s: %s", what, exc)
            return [tf.zeros([0], d) for d in out_dtypes] + [tf.constant(1, tf.int32)]
        return [from_numpy(o, d) for o, d in zip(outs, out_dtypes)] + [tf.constant(0, tf.int32)]

    graph = tf.compat.v1.get_default_graph()
    with tf.control_dependencies(_chain(graph)):
        key = tf.py_function(enqueue, list(inputs), tf.int64, name=f"{label}_enqueue")
    _last_enqueue[graph] = key.op
    results = tf.py_function(finish, [key], list(out_dtypes) + [tf.int32], name=label)
    return _guard(results[:-1], results[-1], what)


def _raiser(exc):
    def wait():
        raise exc
    return wait
