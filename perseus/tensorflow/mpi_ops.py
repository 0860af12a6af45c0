"""TensorFlow collectives on the perseus engine: Horovod's horovod.tensorflow.mpi_ops surface.

Every op works eagerly and inside ``tf.function`` (see :mod:`perseus.tensorflow._core` for how), and every
floating-point op is differentiable through ``tf.custom_gradient`` with Horovod's gradient conventions.
``size_op``/``rank_op``/... are ``tf.constant`` eagerly and a ``tf.py_function`` in a graph, so a traced
graph reads the values when it runs (as Horovod's ops do).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from perseus.runtime import collectives as _c
from perseus.lifecycle.api import (  # noqa: F401 - re-exported
    _basics, ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, init,
    is_homogeneous, is_initialized, local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported,
    nccl_built, rank, rocm_built, shutdown, size, start_timeline, stop_timeline,
)
from perseus.runtime.process_sets import ProcessSet, global_process_set
from perseus.lifecycle import add_process_set, remove_process_set
from perseus.base.reduce_ops import (Adasum, Average, Max, Min, Product, ReduceOp, Sum, reject_adasum,
                                       resolve_op)
from perseus.tensorflow import _core
from perseus.tensorflow._core import engine_dtype as _dtype, op_name as _op_name, ps_info as _ps_info
from perseus.tensorflow.util import _executing_eagerly

__all__ = [
    "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline", "size", "local_size", "cross_size",
    "rank", "local_rank", "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built",
    "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "Average", "Sum", "Adasum",
    "Min", "Max", "Product", "ReduceOp", "size_op", "local_size_op", "rank_op", "local_rank_op",
    "process_set_included_op", "allgather", "grouped_allgather", "broadcast", "broadcast_", "alltoall", "join",
    "barrier", "handle_average_backwards_compatibility", "check_num_rank_power_of_2",
]


def _output_allocators(arrays):
    """One ``alloc(shape)`` per input for outputs whose shape the engine learns (allgather, reducescatter);
    each allocated array is kept in the matching holder list."""
    holders = [[] for _ in arrays]

    def alloc_for(arr, holder):
        def alloc(shape):
            holder.append(np.empty(shape, arr.dtype))
            return holder[0]
        return alloc
    return [alloc_for(a, h) for a, h in zip(arrays, holders)], holders

def _check_has_gpu():
    """False: perseus moves CPU tensors until the GPU transport lands."""
    return False


def handle_average_backwards_compatibility(op, average):
    """Horovod's op/average reconciliation: default Average; ValueError when both are given."""
    return resolve_op(op, average)


def check_num_rank_power_of_2(num_rank):
    """True when ``num_rank`` is a positive power of two."""
    return num_rank > 0 and (num_rank & (num_rank - 1)) == 0


# -- run-time values -----------------------------------------------------------------------------------------
def _int_op(value_fn, name):
    if _executing_eagerly():
        return tf.constant(value_fn(), dtype=tf.int32, name=name)
    out = tf.py_function(lambda: tf.constant(value_fn(), tf.int32), [], tf.int32, name=name)
    out.set_shape([])
    return out


def size_op(process_set_id=0, name=None):
    """Number of ranks of the process set as an int32 scalar, read when the op runs."""
    return _int_op(lambda: len(_basics.process_set_ranks(process_set_id)), name)


def process_set_included_op(process_set_id=0, name=None):
    """1 if this rank belongs to the process set, else 0 (int32 scalar read when the op runs)."""
    return _int_op(lambda: int(_basics.rank() in _basics.process_set_ranks(process_set_id)), name)


def local_size_op(name=None):
    """Number of ranks on this host (int32 scalar read when the op runs)."""
    return _int_op(_basics.local_size, name)


def rank_op(name=None):
    """This process's rank (int32 scalar read when the op runs)."""
    return _int_op(_basics.rank, name)


def local_rank_op(name=None):
    """This process's rank on its host (int32 scalar read when the op runs)."""
    return _int_op(_basics.local_rank, name)


# -- helpers -------------------------------------------------------------------------------------------------
def _tensor(t):
    if isinstance(t, tf.IndexedSlices):
        raise ValueError("perseus: this collective takes dense tensors; pass tf.IndexedSlices to allreduce, or "
                         "convert with tf.convert_to_tensor")
    try:
        return tf.convert_to_tensor(t)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"perseus expected a tensor, got {type(t).__name__}: {exc}") from None


def _grad_or_zeros(dy, y):
    return tf.zeros_like(y) if dy is None else dy


def _reduce_op(op, dts, what):
    op = resolve_op(op, None) if what == "allreduce" else reject_adasum(op, what)  # Adasum: allreduce only
    if op == Average and any(d == tf.bool for d in dts):
        raise ValueError(f"perseus.{what}: op=Average is not defined for bool tensors; use Sum, Min or Max")
    return op


def _rows(shape):
    """[None] + trailing dims: the static shape of a concatenation along the first dimension."""
    if shape.rank is None:
        return tf.TensorShape(None)
    return tf.TensorShape([None] + shape.as_list()[1:])


# -- allreduce -----------------------------------------------------------------------------------------------
def _grouped_allreduce(tensors, name=None, op=Sum, prescale_factor=1.0, postscale_factor=1.0,
                       ignore_name_scope=False, process_set=global_process_set, _single=False):
    """Allreduce a list of dense tensors in one negotiated group (the raw op: default Sum)."""
    tensors = [_tensor(t) for t in tensors]
    dts = [_dtype(t) for t in tensors]
    op = _reduce_op(op, [t.dtype for t in tensors], "allreduce")
    _ps_info(process_set)
    kind = "HorovodAllreduce" if _single else "HorovodGroupedAllreduce"
    req = _op_name(kind, name, tensors, ignore_name_scope)
    pre, post = float(prescale_factor), float(postscale_factor)

    @tf.custom_gradient
    def fwd(*xs):
        def fn(arrays):
            outs = [np.empty_like(a) for a in arrays]
            if _single:
                h = _c.allreduce_async(arrays[0], outs[0], req, op, pre, post, process_set, dtype=dts[0],
                                       finish=lambda r: outs)
            else:
                h = _c.grouped_allreduce_async(arrays, outs, req, op, pre, post, process_set, dtypes=dts,
                                               finish=lambda r: outs)
            return _core.Pending([h])

        ys = _core.run(fn, list(xs), [x.dtype for x in xs], f"perseus.allreduce({req or 'noname'})")
        for y, x in zip(ys, xs):
            y.set_shape(x.shape)

        def grad(*dys):
            dys = [_grad_or_zeros(d, y) for d, y in zip(dys, ys)]
            return _grouped_allreduce(dys, op=op, prescale_factor=pre, postscale_factor=post,
                                      ignore_name_scope=ignore_name_scope, process_set=process_set,
                                      _single=_single)
        return ys, grad

    return list(fwd(*tensors))


def _allreduce(tensor, name=None, op=Sum, prescale_factor=1.0, postscale_factor=1.0, ignore_name_scope=False,
               process_set=global_process_set):
    """Reduce a dense tensor over the process set (the raw op: default Sum). Differentiable: the gradient is
    the same allreduce of the upstream gradient."""
    return _grouped_allreduce([tensor], name, op, prescale_factor, postscale_factor, ignore_name_scope,
                              process_set, _single=True)[0]


# -- allgather -----------------------------------------------------------------------------------------------
def _first_dims(xs, ignore_name_scope, process_set):
    """int32 [set size, len(xs)]: every rank's first dimension of each tensor (1 for scalars)."""
    mine = tf.stack([tf.shape(x)[0] if x.shape.rank != 0 else tf.constant(1) for x in xs])
    return allgather(tf.reshape(mine, [1, len(xs)]), ignore_name_scope=ignore_name_scope,
                     process_set=process_set)


def grouped_allgather(tensors, name=None, ignore_name_scope=False, process_set=global_process_set,
                      _single=False):
    """Allgather each tensor of ``tensors`` (concatenate along the first dimension, which may differ between
    ranks), negotiated together. Differentiable: the gradient averages the upstream gradient over the ranks
    and returns this rank's rows, as Horovod does."""
    tensors = [_tensor(t) for t in tensors]
    if not tensors:
        return []
    dts = [_dtype(t) for t in tensors]
    _ps_info(process_set)
    req = _op_name("HorovodAllgather" if _single else "HorovodGroupedAllgather", name, tensors,
                   ignore_name_scope)

    @tf.custom_gradient
    def fwd(*xs):
        def fn(arrays):
            allocs, holders = _output_allocators(arrays)
            finish = lambda r: [h[0] for h in holders]  # noqa: E731
            if _single:
                h = _c.allgather_async(arrays[0], allocs[0], req, process_set, dtype=dts[0], finish=finish)
            else:
                h = _c.grouped_allgather_async(arrays, allocs, req, process_set, dtypes=dts, finish=finish)
            return _core.Pending([h])

        ys = _core.run(fn, list(xs), [x.dtype for x in xs], f"perseus.allgather({req or 'noname'})")
        for y, x in zip(ys, xs):
            y.set_shape(_rows(x.shape) if x.shape.rank != 0 else tf.TensorShape([None]))

        def grad(*dys):
            dys = [_grad_or_zeros(d, y) for d, y in zip(dys, ys)]
            if _single:
                dys = [_allreduce(dys[0], op=Average, ignore_name_scope=ignore_name_scope,
                                  process_set=process_set)]
            else:
                dys = _grouped_allreduce(dys, op=Average, ignore_name_scope=ignore_name_scope,
                                         process_set=process_set)
            dims = _first_dims(xs, ignore_name_scope, process_set)
            me = _ps_info(process_set)[2]
            offsets = tf.reduce_sum(dims[:me], axis=0)
            return [tf.reshape(d[offsets[i]:offsets[i] + dims[me, i]], tf.shape(x))
                    for i, (d, x) in enumerate(zip(dys, xs))]
        return ys, grad

    return list(fwd(*tensors))


def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Concatenate ``tensor`` from every rank of the process set along the first dimension. Differentiable."""
    return grouped_allgather([tensor], name, ignore_name_scope, process_set, _single=True)[0]


# -- broadcast -----------------------------------------------------------------------------------------------
def _broadcast_arrays(arrays, dts, root_rank, names, process_set):
    outs = [np.empty_like(a) for a in arrays]
    hs = [_c.broadcast_async(a, o, root_rank, n, process_set, dtype=d, finish=lambda r: None)
          for a, o, d, n in zip(arrays, outs, dts, names)]

    return _core.Pending(hs, lambda results: outs)


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Return ``tensor`` as held by job rank ``root_rank``. Differentiable: the gradient is the average of
    the upstream gradients on the root and zero elsewhere, as Horovod does."""
    tensor = _tensor(tensor)
    dt = _dtype(tensor)
    root_rank = int(root_rank)
    _ps_info(process_set)
    req = _op_name("HorovodBroadcast", name, [tensor], ignore_name_scope)

    @tf.custom_gradient
    def fwd(x):
        y = _core.run(lambda arrays: _broadcast_arrays(arrays, [dt], root_rank, [req], process_set), [x],
                      [x.dtype], f"perseus.broadcast({req or 'noname'})")[0]
        y.set_shape(x.shape)

        def grad(dy):
            reduced = _allreduce(_grad_or_zeros(dy, y), op=Average, ignore_name_scope=ignore_name_scope,
                                 process_set=process_set)
            return reduced if rank() == root_rank else reduced * 0
        return y, grad

    return fwd(tensor)


def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """Overwrite each of ``variables`` (a tf.Variable or Keras variable, or a list of them) with the root's
    values, in place.

    Returns the updated values (a list). Collective: every rank passes variables of the same shapes and
    dtypes, in the same order.
    """
    single = _is_variable(variables)
    variables = [variables] if single else list(variables)
    if not variables:
        return []
    if not all(_is_variable(v) for v in variables):
        raise TypeError("perseus.broadcast_: expected tf.Variable or Keras variable objects; use broadcast() "
                        "for tensors")
    values = [tf.convert_to_tensor(v) for v in variables]
    dts = [_dtype(v) for v in values]
    _ps_info(process_set)
    base = _op_name("HorovodBroadcastInplace", name, values, False)
    names = [None if base is None else f"{base}.{i}" for i in range(len(values))]
    outs = _core.run(lambda arrays: _broadcast_arrays(arrays, dts, int(root_rank), names, process_set), values,
                     [v.dtype for v in values], f"perseus.broadcast_({base or 'noname'})")
    updated = []
    for var, out in zip(variables, outs):
        out.set_shape(var.shape)
        backing = _backing_variable(var)
        if _executing_eagerly() or backing is None:
            # Eagerly, and in tf.function (automatic control dependencies order the read after the write).
            var.assign(out)
            updated.append(tf.convert_to_tensor(var))
        else:
            # In a TF1 graph nothing orders a read after an assignment unless it is told to, so assign the
            # tf.Variable itself (a Keras 3 variable's assign() returns the value, not the assignment op).
            with tf.control_dependencies([backing.assign(out)]):
                updated.append(backing.read_value())
    return updated


def _is_variable(v) -> bool:
    """tf.Variable, or a Keras 3 variable (no tf.Variable subclass, but assignable and convertible)."""
    return isinstance(v, tf.Variable) or (hasattr(v, "assign") and hasattr(v, "dtype") and hasattr(v, "shape")
                                          and not isinstance(v, (list, tuple)))


def _backing_variable(v):
    """The tf.Variable holding ``v``'s value: ``v`` itself, a Keras 3 variable's ``value`` (a tf.Variable
    under the TensorFlow backend), or None when there is none to reach."""
    if isinstance(v, tf.Variable):
        return v
    value = getattr(v, "value", None)
    return value if isinstance(value, tf.Variable) else None


# -- alltoall ------------------------------------------------------------------------------------------------
def alltoall(tensor, splits=None, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Send rows ``splits[i]`` of ``tensor`` to rank i of the process set (equal parts when ``splits`` is
    None); return the received rows, and with ``splits`` also the int32 counts received from each rank.
    Differentiable: the gradient is the alltoall of the upstream gradient with the received splits."""
    tensor = _tensor(tensor)
    dt = _dtype(tensor)
    _, set_size, _ = _ps_info(process_set)
    splits_t = tf.zeros([0], tf.int32) if splits is None else tf.cast(tf.convert_to_tensor(splits), tf.int32)
    req = _op_name("HorovodAlltoall", name, [tensor], ignore_name_scope)

    @tf.custom_gradient
    def fwd(x):
        def fn(arrays):
            holder = []

            def alloc(shape):
                holder.append(np.empty(shape, arrays[0].dtype))
                return holder[0]
            sp = arrays[1].astype(np.int64) if arrays[1].size else None
            h = _c.alltoall_async(arrays[0], sp, alloc, req, process_set, dtype=dt,
                                  finish=lambda r: [holder[0], r[0].received_splits.astype(np.int32)])
            return _core.Pending([h])

        y, received = _core.run(fn, [x, splits_t], [x.dtype, tf.int32], f"perseus.alltoall({req or 'noname'})")
        y.set_shape(_rows(x.shape) if x.shape.rank != 0 else tf.TensorShape([None]))
        received.set_shape([set_size])

        def grad(dy, _unused=None):
            back, _ = alltoall(_grad_or_zeros(dy, y), splits=received, ignore_name_scope=ignore_name_scope,
                               process_set=process_set)
            return tf.reshape(back, tf.shape(x))
        return (y, received), grad

    y, received = fwd(tensor)
    return (y, received) if splits is not None else y


# -- reducescatter -------------------------------------------------------------------------------------------
def _grouped_reducescatter(tensors, name=None, op=Sum, ignore_name_scope=False, process_set=global_process_set,
                           prescale_factor=1.0, postscale_factor=1.0, _single=False):
    """Reduce each tensor over the process set and keep this rank's share of the first dimension (earlier
    ranks get one extra row when it does not divide). Differentiable: the gradient is the allgather of the
    upstream gradient, times the set size for Sum and times the scale factors, as Horovod does."""
    tensors = [_tensor(t) for t in tensors]
    if not tensors:
        return []
    dts = [_dtype(t) for t in tensors]
    op = _reduce_op(op, [t.dtype for t in tensors], "reducescatter")
    _, set_size, me = _ps_info(process_set)
    req = _op_name("HorovodReducescatter" if _single else "HorovodGroupedReducescatter", name, tensors,
                   ignore_name_scope)
    pre, post = float(prescale_factor), float(postscale_factor)

    @tf.custom_gradient
    def fwd(*xs):
        def fn(arrays):
            allocs, holders = _output_allocators(arrays)
            h = _c.grouped_reducescatter_async(arrays, allocs, req, op, process_set, pre, post, dtypes=dts,
                                               finish=lambda r: [h[0] for h in holders], _single=_single)
            return _core.Pending([h])

        ys = _core.run(fn, list(xs), [x.dtype for x in xs], f"perseus.reducescatter({req or 'noname'})")
        for y, x in zip(ys, xs):
            shape = x.shape.as_list() if x.shape.rank else None
            if shape and shape[0] is not None:
                shape[0] = shape[0] // set_size + (1 if me < shape[0] % set_size else 0)
            y.set_shape(tf.TensorShape(shape) if shape else _rows(x.shape))

        def grad(*dys):
            factor = (set_size if op == Sum else 1) * pre * post
            dys = [_grad_or_zeros(d, y) for d, y in zip(dys, ys)]
            dys = [d * tf.cast(factor, d.dtype) if factor != 1 else d for d in dys]
            return [allgather(d, ignore_name_scope=ignore_name_scope, process_set=process_set) for d in dys]
        return ys, grad

    return list(fwd(*tensors))


def _reducescatter(tensor, name=None, op=Sum, ignore_name_scope=False, process_set=global_process_set,
                   prescale_factor=1.0, postscale_factor=1.0):
    """Reducescatter one tensor (the raw op: default Sum)."""
    return _grouped_reducescatter([tensor], name, op, ignore_name_scope, process_set, prescale_factor,
                                  postscale_factor, _single=True)[0]


# -- join / barrier ------------------------------------------------------------------------------------------
def join():
    """Wait until every rank has joined (meanwhile this rank contributes zeros to the others' allreduces).

    Returns the rank that joined last, as an int32 scalar tensor.
    """
    if _executing_eagerly():
        return tf.constant(_c.join(), tf.int32)
    out = tf.py_function(lambda: tf.constant(_c.join(), tf.int32), [], tf.int32, name="HorovodJoin")
    out.set_shape([])
    return out


def barrier(process_set=global_process_set):
    """Block until every rank of ``process_set`` reaches the barrier (in a graph: when the op runs)."""
    if _executing_eagerly():
        _c.barrier(process_set)
        return None

    def body():
        _c.barrier(process_set)
        return tf.constant(0, tf.int32)
    return tf.py_function(body, [], tf.int32, name="HorovodBarrier")

