"""Horovod's public horovod.tensorflow allreduce/reducescatter: compression, tf.IndexedSlices, defaults.

A communicating compressor (``Compression.topk(0.01)``, any :class:`perseus.compression.Reducer`) runs its own
collective: :func:`reduce_with` hands the tensors to it as NumPy arrays through the same eager/graph bridge as
the other collectives (:func:`perseus.tensorflow._core.run`) and turns its dense results back into tensors.
"""

from __future__ import annotations

import threading

import numpy as np
import tensorflow as tf

from perseus.runtime.process_sets import global_process_set
from perseus.base.reduce_ops import Adasum, Average, ReduceOp, Sum, resolve_op
from perseus import sparse as _sparse
from perseus.compression import Reducer
from perseus.compression.base import _to_bf16_words
from perseus.tensorflow import _core
from perseus.tensorflow.compression import Compression
from perseus.tensorflow.mpi_ops import (_grouped_allreduce, _grouped_reducescatter, _ps_info, _reducescatter,
                                        grouped_allgather)

__all__ = ["allreduce", "grouped_allreduce", "reducescatter", "grouped_reducescatter", "reduce_with"]


class _ReducerResults:
    """:func:`_core.run`'s view of a reducer's in-flight work (one :class:`perseus.compression.Pending` per
    group). Eagerly :meth:`wait` collects the results on the caller's thread. In a graph, :meth:`on_done`
    collects them on a helper thread and then completes the await op, so no TensorFlow thread waits for the
    peers (the finish op finds the results ready), as for the engine's own collectives."""

    __slots__ = ("pendings", "_done", "_outs", "_exc")

    def __init__(self, pendings):
        self.pendings = pendings
        self._done = None
        self._outs = self._exc = None

    def _collect(self):
        return [out for p in self.pendings for out in p.wait()]

    def on_done(self, callback):
        self._done = threading.Event()

        def work():
            try:
                self._outs = self._collect()
            except BaseException as exc:  # noqa: BLE001 - handed to the finish op, which raises it
                self._exc = exc
            finally:
                self._done.set()
                callback()
        threading.Thread(target=work, name="perseus-compressed-reduce", daemon=True).start()

    def wait(self):
        if self._done is None:
            return self._collect()
        self._done.wait()
        if self._exc is not None:
            raise self._exc
        return self._outs


def _dense(t):
    """A dense tensor (tf.IndexedSlices are densified)."""
    return tf.convert_to_tensor(t)


def reduce_with(reducer, groups, keys, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                process_set=global_process_set, local=None):
    """Reduce with a communicating compressor: each of ``groups`` (a list of tensors, tf.IndexedSlices
    densified) is compressed as one vector under its key in ``keys``; returns one list of dense tensors per
    group, in the inputs' shapes and dtypes. Works eagerly and in a graph (one op for all the groups, whose
    collectives are all started before the first is awaited). Not differentiable.

    ``local`` (a :class:`perseus.compression.local_step.LocalStep`, the same for every group) is passed to
    the compressor's ``reduce_async``: its momentum correction; the results are then averaged updates.

    Collective: every rank of ``process_set`` passes the same keys with tensors of the same sizes.

    Raises:
        ValueError: a missing key, a non-floating-point tensor, an op other than Sum/Average, or ``local``
            given to a compressor that does not take it (from the op, when it runs).
    """
    op = ReduceOp(op)
    groups = [[_dense(t) for t in g] for g in groups]
    keys = list(keys)
    if len(keys) != len(groups):
        raise ValueError(f"perseus: {len(groups)} groups of tensors but {len(keys)} keys")
    what = f"perseus.allreduce({type(reducer).__name__}: {keys[0] if keys else ''})"
    for key, group in zip(keys, groups):
        if not key:
            raise ValueError(f"perseus: {reducer!r} keeps state per tensor and needs a name: pass name= to "
                             "allreduce (DistributedGradientTape and DistributedOptimizer name gradients after "
                             "their variables)")
        for t in group:
            if not t.dtype.is_floating:
                raise ValueError(f"perseus: {type(reducer).__name__} compresses floating-point tensors only; "
                                 f"{key!r} is {t.dtype.name}")
    if op not in (Sum, Average):
        raise ValueError(f"perseus: {type(reducer).__name__} reduces with Sum or Average only, not {op.name}")
    _ps_info(process_set)
    flat = [t for g in groups for t in g]
    if not flat:
        return [[] for _ in groups]
    sizes = [len(g) for g in groups]
    pre, post = float(prescale_factor), float(postscale_factor)
    extra = {} if local is None else {"local": local}

    def fn(arrays):
        pendings, off = [], 0
        for key, n in zip(keys, sizes):
            if n:
                pendings.append(reducer.reduce_async(key, arrays[off:off + n], None, op, pre, post, process_set,
                                                     **extra))
            off += n
        return _ReducerResults(pendings)

    outs = _core.run(fn, flat, [t.dtype for t in flat], what)
    result, off = [], 0
    for n in sizes:
        part = list(outs[off:off + n])
        for y, x in zip(part, flat[off:off + n]):
            y.set_shape(x.shape)
        result.append(part)
        off += n
    return result


def _sparse_checks(op, prescale_factor, postscale_factor):
    if op == Adasum:
        raise NotImplementedError("The Adasum reduction does not support tf.IndexedSlices; pass "
                                  "sparse_as_dense=True to DistributedOptimizer/DistributedGradientTape")
    if op not in (Sum, Average):
        raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")


class _SparseResults:
    """:func:`_core.run`'s view of in-flight sparse reductions (one :class:`perseus.sparse.SparseHandle`
    per tf.IndexedSlices): :meth:`wait` gives values and indices per slice, :meth:`on_done` calls back once
    all have finished (on the thread that finished the last; no TensorFlow thread waits)."""

    __slots__ = ("handles", "specs")

    def __init__(self, handles, specs):
        self.handles, self.specs = handles, specs

    def on_done(self, callback):
        left = [len(self.handles)]
        lock = threading.Lock()
        if not self.handles:
            callback()
            return

        def one():
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                callback()
        for h in self.handles:
            h.on_done(one)

    def wait(self):
        outs = []
        for h, (row_shape, index_dtype, bf16) in zip(self.handles, self.specs):
            res = h.wait()
            values = res.values.reshape((res.rows.size,) + row_shape)
            outs += [_to_bf16_words(values) if bf16 else values, res.rows.astype(index_dtype, copy=False)]
        return outs


def _gathered_slices(slices, op, process_set, ignore_name_scope, set_size):
    """Allgather the values and indices of each tf.IndexedSlices (differentiable); Average divides the
    gathered values by the set size."""
    values = grouped_allgather([s.values for s in slices], process_set=process_set,
                               ignore_name_scope=ignore_name_scope)
    indices = grouped_allgather([s.indices for s in slices], process_set=process_set,
                                ignore_name_scope=ignore_name_scope)
    out = []
    for v, i, s in zip(values, indices, slices):
        if op == Average:
            v = v / tf.cast(set_size, v.dtype)
        out.append(tf.IndexedSlices(v, i, dense_shape=s.dense_shape))
    return out


def _sparse_allreduce(slices, op, process_set, ignore_name_scope, names=None, algorithm=None):
    """Reduce each tf.IndexedSlices with perseus's sparse all-reduce (:mod:`perseus.sparse`: Zen, allgather,
    dense or alltoall, or 'auto'; ``algorithm`` None reads PERSEUS_SPARSE_ALGORITHM), eagerly and in a
    graph (one op for all of them). A slice without a dense_shape can only be all-gathered. The results are
    tf.IndexedSlices of the same dense shapes; except with allgather their indices are sorted and unique.
    Not differentiable."""
    set_size = _ps_info(process_set)[1]
    algorithm = _sparse.resolve_algorithm(algorithm)
    if any(not (s.values.dtype.is_floating or s.values.dtype == tf.bfloat16) for s in slices):
        # Integer values (Horovod's own tests reduce them, Average included): the allgather of values and
        # indices as Horovod does it, with Average dividing the gathered values as TensorFlow divides.
        return _gathered_slices(slices, op, process_set, ignore_name_scope, set_size)
    names = list(names) if names is not None else [None] * len(slices)
    keys = [_core.op_name("HorovodSparseAllreduce", nm, [s.values], ignore_name_scope) for nm, s in zip(names, slices)]
    inputs, out_dtypes = [], []
    for s in slices:
        shape = s.dense_shape if s.dense_shape is not None else tf.constant([-1], tf.int64)
        inputs += [s.values, s.indices, shape]
        out_dtypes += [s.values.dtype, s.indices.dtype]

    def fn(arrays):
        handles, specs = [], []
        for j, key in enumerate(keys):
            values, indices, shape = arrays[3 * j:3 * j + 3]
            shape = np.asarray(shape).reshape(-1)
            rows = int(shape[0]) if shape.size and int(shape[0]) >= 0 else None
            bf16 = slices[j].values.dtype == tf.bfloat16
            if bf16:
                values = (values.astype(np.uint32) << 16).view(np.float32)
            handles.append(_sparse.sparse_allreduce_async(indices.reshape(-1), values, rows, key, op, process_set,
                                                          algorithm))
            specs.append((tuple(values.shape[1:]), indices.dtype, bf16))
        return _SparseResults(handles, specs)

    outs = _core.run(fn, inputs, out_dtypes, f"perseus.allreduce(tf.IndexedSlices: {keys[0] if keys else ''})")
    result = []
    for j, s in enumerate(slices):
        values, indices = outs[2 * j], outs[2 * j + 1]
        values.set_shape(tf.TensorShape([None]).concatenate(s.values.shape[1:]))
        indices.set_shape([None])
        result.append(tf.IndexedSlices(values, indices, dense_shape=s.dense_shape))
    return result


def allreduce(tensor, average=None, device_dense='', device_sparse='', compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, name=None, process_set=global_process_set,
              ignore_name_scope=False, sparse_algorithm=None):
    """Reduce a tf.Tensor, tf.Variable or tf.IndexedSlices over the ranks of ``process_set``.

    ``op`` defaults to Average (``average`` is Horovod's deprecated spelling). ``device_dense`` and
    ``device_sparse`` are accepted for compatibility (perseus moves host memory). Differentiable for dense
    tensors.

    A tf.IndexedSlices (Sum or Average only, no scale factors) is reduced by perseus's sparse all-reduce
    and stays a tf.IndexedSlices of the same dense shape: ``sparse_algorithm`` (a perseus addition) is 'zen',
    'allgather' (Horovod's path: values and indices gathered from every rank), 'dense', 'alltoall' or 'auto'
    (the cheapest by a cost model; docs/sparse.md); None reads PERSEUS_SPARSE_ALGORITHM (default 'auto').
    Except with allgather the indices come back sorted and unique. Not differentiable.

    With a communicating compressor (``compression=Compression.topk(0.01)``, see docs/compression.md) the
    result is that compressor's dense estimate of the reduction (Sum or Average; a tf.IndexedSlices is
    densified first; not differentiable). It keeps a residual per tensor, so ``name=`` is required eagerly
    (in a graph an unnamed tensor is named after its graph tensor, which is stable across steps).

    Collective: every rank of ``process_set`` calls it with the same name, shape, dtype and op.
    """
    op = resolve_op(op, average)
    if isinstance(compression, Reducer):
        tensor = _dense(tensor)
        key = _core.op_name("HorovodAllreduce", name, [tensor], ignore_name_scope)
        return reduce_with(compression, [[tensor]], [key], op, prescale_factor, postscale_factor,
                           process_set)[0][0]
    if isinstance(tensor, tf.IndexedSlices):
        _sparse_checks(op, prescale_factor, postscale_factor)
        return _sparse_allreduce([tensor], op, process_set, ignore_name_scope, [name], sparse_algorithm)[0]
    compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
    reduced = _grouped_allreduce([compressed], name, op, prescale_factor, postscale_factor, ignore_name_scope,
                                 process_set, _single=True)
    return compression.decompress(reduced[0], ctx)


def grouped_allreduce(tensors, average=None, device_dense='', device_sparse='', compression=Compression.none,
                      op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set,
                      ignore_name_scope=False, name=None, sparse_algorithm=None):
    """Reduce each of ``tensors`` (dense tensors negotiated as one group; tf.IndexedSlices by the sparse
    all-reduce, see :func:`allreduce` for ``sparse_algorithm``). Returns a list in the input order.
    Differentiable for dense tensors.

    With a communicating compressor (``Compression.topk(0.01)``) the group is densified and compressed as one
    vector keyed by ``name`` (required eagerly; see :func:`allreduce`); not differentiable."""
    if not tensors:
        return tensors
    op = resolve_op(op, average)
    tensors = list(tensors)
    if isinstance(compression, Reducer):
        tensors = [_dense(t) for t in tensors]
        key = _core.op_name("HorovodGroupedAllreduce", name, tensors, ignore_name_scope)
        return reduce_with(compression, [tensors], [key], op, prescale_factor, postscale_factor, process_set)[0]
    sparse_idx = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense_idx = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    out = [None] * len(tensors)
    if sparse_idx:
        _sparse_checks(op, prescale_factor, postscale_factor)
        names = None if name is None else [f"{name}.sparse{i}" for i in sparse_idx]
        for i, r in zip(sparse_idx, _sparse_allreduce([tensors[i] for i in sparse_idx], op, process_set,
                                                      ignore_name_scope, names, sparse_algorithm)):
            out[i] = r
    if dense_idx:
        pairs = [compression.compress(tf.convert_to_tensor(tensors[i])) for i in dense_idx]
        reduced = _grouped_allreduce([p[0] for p in pairs], name, op, prescale_factor, postscale_factor,
                                     ignore_name_scope, process_set)
        for i, r, (_, ctx) in zip(dense_idx, reduced, pairs):
            out[i] = compression.decompress(r, ctx)
    return out


def reducescatter(tensor, device_dense='', compression=Compression.none, op=Average, name=None,
                  process_set=global_process_set, ignore_name_scope=False, prescale_factor=1.0,
                  postscale_factor=1.0):
    """Reduce ``tensor`` over the ranks (default Average) and return this rank's share of the first
    dimension (earlier ranks get one extra row when it does not divide evenly). Differentiable."""
    op = ReduceOp(op)
    compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
    out = _reducescatter(compressed, name=name, op=op, ignore_name_scope=ignore_name_scope,
                         process_set=process_set, prescale_factor=prescale_factor,
                         postscale_factor=postscale_factor)
    return compression.decompress(out, ctx)


def grouped_reducescatter(tensors, device_dense='', compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reducescatter each of ``tensors``, negotiated together. Differentiable."""
    if not tensors:
        return tensors
    pairs = [compression.compress(tf.convert_to_tensor(t)) for t in tensors]
    outs = _grouped_reducescatter([p[0] for p in pairs], op=ReduceOp(op), process_set=process_set,
                                  prescale_factor=prescale_factor, postscale_factor=postscale_factor)
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]
