"""``DistributedOptimizer(op=hvd.Adasum)`` for TensorFlow: Adasum applied to each rank's model update.

Adasum combines vectors by how much they agree, so it should see what the optimizer does with a gradient
(momentum, Adam's scaling, the learning rate), not the raw gradient. This is the design of
perseus.torch's ``DistributedOptimizer(op=Adasum)`` (perseus/torch/adasum_optimizer.py), for TensorFlow:

- the gradients are not reduced where they are computed (:func:`local_gradients_fn` stands in for the
  reduction of ``compute_gradients``, ``get_gradients`` and the Keras ``apply``);
- where they are applied (:func:`apply_adasum`), each rank remembers its variables' values (``start``), runs
  the wrapped optimizer's own apply on its own gradients, takes ``delta = variable - start``, combines every
  rank's deltas with one grouped Adasum all-reduce, and sets ``variable = start + combined delta``.

Both the TF1 optimizer (perseus/tensorflow/legacy_optimizer.py) and the Keras one
(perseus/tensorflow/keras_optimizer.py) use it, eagerly, inside ``tf.function`` (``model.fit``) and in TF1
graphs. A variable whose gradient is None (or that the optimizer leaves alone) contributes a zero update, so
every rank runs the same collective. Sparse gradients (``tf.IndexedSlices``) are applied by the optimizer as
they are; the update of the variable is dense.
"""

from __future__ import annotations

import tensorflow as tf

from perseus.base.reduce_ops import Adasum
from perseus.compression import Reducer
from perseus.tensorflow._reduce import grouped_allreduce

__all__ = ["check_adasum_options", "local_gradients_fn", "apply_adasum"]


def check_adasum_options(compression, groups, gradient_predivide_factor) -> None:
    """Refuse the DistributedOptimizer options that op=Adasum cannot honour. Local; call it when the
    optimizer is made.

    Raises:
        NotImplementedError: a communicating compressor (a :class:`perseus.compression.Reducer`: Adasum needs
            each rank's whole update; ``Compression.none``, ``fp16`` and ``bf16`` work), or ``groups``.
        ValueError: ``gradient_predivide_factor`` other than 1.
    """
    if isinstance(compression, Reducer):
        raise NotImplementedError("DistributedOptimizer(op=Adasum) takes Compression.none, fp16 or bf16, not a "
                                  "communicating compressor; Adasum needs each rank's whole update")
    if groups:
        raise NotImplementedError("DistributedOptimizer(op=Adasum): groups are not supported; leave groups "
                                  "(and num_groups) unset")
    if gradient_predivide_factor != 1.0:
        raise ValueError("gradient_predivide_factor not supported with op != Average")


def local_gradients_fn(sparse_as_dense):
    """An ``allreduce_grads(grads, vars=None, use_generic_names=False, local=None)`` that reduces nothing: the
    gradients come back as they are (``tf.IndexedSlices`` densified when ``sparse_as_dense``), for the
    optimizer to apply locally before :func:`apply_adasum` combines the updates. Local: no collective."""

    def local_gradients(grads, vars=None, use_generic_names=False, local=None):
        if local is not None:
            raise ValueError("perseus: DistributedOptimizer(op=Adasum) has no momentum correction")
        grads = list(grads)
        if sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        return grads

    return local_gradients


def _value(var):
    """A read of ``var`` (a ``tf.Variable`` or a Keras 3 variable) made where this is called, so that control
    dependencies around it order it."""
    return tf.convert_to_tensor(var)


def _snapshot(var):
    """A copy of ``var``'s value now: the optimizer's update may then change the variable in place."""
    return tf.raw_ops.Snapshot(input=_value(var))


def apply_adasum(apply_fn, variables, compression, process_set, name="DistributedOptimizer", keep_local=None):
    """Run ``apply_fn()`` (the wrapped optimizer applying this rank's own gradients to ``variables``) and
    replace each variable's local update by the Adasum of every rank's update: ``variable = start +
    Adasum(variable - start)``, with ``start`` the variable's value before ``apply_fn``.

    ``variables``: every variable the step may update, in the same order on every rank (those whose gradient
    is None are reduced with a zero update). ``keep_local(variable)`` True: that variable keeps its local
    update (registered local variables, model-parallel shards). ``compression``: ``Compression.none``, ``fp16``
    or ``bf16``, applied to the updates on the wire. ``name`` scopes the graph's ops.

    Eagerly the updates are made before it returns, which gives ``apply_fn``'s result. In a graph
    (``tf.function`` or a TF1 graph) it returns an op that runs the whole step: the local apply, the
    all-reduce and the assignments. A rank outside ``process_set``, or a set of one rank, runs ``apply_fn()``
    alone and returns its result.

    Collective: every rank of ``process_set`` must call it at the same step with the same variables (shapes
    and floating-point dtypes).

    Raises:
        ValueError: a variable that is not floating-point (Adasum combines floating-point tensors only).
    """
    if not process_set.included() or process_set.size() <= 1:
        return apply_fn()
    shared = [v for v in variables if keep_local is None or not keep_local(v)]
    if not shared:
        return apply_fn()
    for v in shared:
        dtype = tf.as_dtype(v.dtype)  # (a Keras 3 variable's dtype is a string)
        if not dtype.is_floating:
            raise ValueError(f"perseus: DistributedOptimizer(op=Adasum) combines floating-point variables only; "
                             f"{getattr(v, 'name', v)!r} is {dtype.name}")
    with tf.name_scope(f"{name}_Adasum"):
        starts = [_snapshot(v) for v in shared]
    with tf.control_dependencies(starts):
        result = apply_fn()
    after = [result] if isinstance(result, (tf.Tensor, tf.Operation)) else []
    with tf.name_scope(f"{name}_Adasum"):
        with tf.control_dependencies(after):
            deltas = [_value(v) - s for v, s in zip(shared, starts)]
        combined = grouped_allreduce(deltas, compression=compression, op=Adasum, process_set=process_set)
        assigns = [v.assign(s + tf.cast(d, s.dtype)) for v, s, d in zip(shared, starts, combined)]
    if tf.executing_eagerly():
        return result
    # (a resource variable's assign gives an unread variable in a graph; its .op is the assignment)
    ops = [a if isinstance(a, tf.Operation) else getattr(a, "op", None) for a in assigns]
    return tf.group(*[o for o in ops if isinstance(o, tf.Operation)], *after)
