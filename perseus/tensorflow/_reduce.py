"""Horovod's public horovod.tensorflow allreduce/reducescatter: compression, tf.IndexedSlices, defaults."""

from __future__ import annotations

import tensorflow as tf

from perseus.common.process_sets import global_process_set
from perseus.common.reduce_ops import Adasum, Average, ReduceOp, Sum, resolve_op
from perseus.tensorflow.compression import Compression
from perseus.tensorflow.mpi_ops import (_grouped_allreduce, _grouped_reducescatter, _ps_info, _reducescatter,
                                        grouped_allgather)

__all__ = ["allreduce", "grouped_allreduce", "reducescatter", "grouped_reducescatter"]


def _sparse_checks(op, prescale_factor, postscale_factor):
    if op == Adasum:
        raise NotImplementedError("The Adasum reduction does not support tf.IndexedSlices; pass "
                                  "sparse_as_dense=True to DistributedOptimizer/DistributedGradientTape")
    if op not in (Sum, Average):
        raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")


def _sparse_allreduce(slices, op, process_set, ignore_name_scope):
    """Allgather values and indices of each tf.IndexedSlices (an allreduce of the dense tensors they stand
    for); Average divides the gathered values by the set size."""
    set_size = _ps_info(process_set)[1]
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


def allreduce(tensor, average=None, device_dense='', device_sparse='', compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, name=None, process_set=global_process_set,
              ignore_name_scope=False):
    """Reduce a tf.Tensor, tf.Variable or tf.IndexedSlices over the ranks of ``process_set``.

    ``op`` defaults to Average (``average`` is Horovod's deprecated spelling). A tf.IndexedSlices is reduced
    by allgathering its values and indices (Sum or Average only, no scale factors). ``device_dense`` and
    ``device_sparse`` are accepted for compatibility (perseus moves host memory). Differentiable.

    Collective: every rank of ``process_set`` calls it with the same name, shape, dtype and op.
    """
    op = resolve_op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        _sparse_checks(op, prescale_factor, postscale_factor)
        return _sparse_allreduce([tensor], op, process_set, ignore_name_scope)[0]
    compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
    reduced = _grouped_allreduce([compressed], name, op, prescale_factor, postscale_factor, ignore_name_scope,
                                 process_set, _single=True)
    return compression.decompress(reduced[0], ctx)


def grouped_allreduce(tensors, average=None, device_dense='', device_sparse='', compression=Compression.none,
                      op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set,
                      ignore_name_scope=False, name=None):
    """Reduce each of ``tensors`` (dense tensors negotiated as one group; tf.IndexedSlices through grouped
    allgathers). Returns a list in the input order. Differentiable."""
    if not tensors:
        return tensors
    op = resolve_op(op, average)
    tensors = list(tensors)
    sparse_idx = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense_idx = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    out = [None] * len(tensors)
    if sparse_idx:
        _sparse_checks(op, prescale_factor, postscale_factor)
        for i, r in zip(sparse_idx, _sparse_allreduce([tensors[i] for i in sparse_idx], op, process_set,
                                                      ignore_name_scope)):
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
