"""DistributedGradientTape: a tf.GradientTape whose gradient() averages gradients across ranks.

The reduction of a step's gradients is one grouped allreduce (dense gradients negotiated and fused together;
tf.IndexedSlices through the sparse algorithms of docs/sparse.md, or densified with ``sparse_as_dense``).
``groups`` splits it into several groups as Horovod does. The Keras ``DistributedOptimizer`` (perseus.tensorflow._keras) shares the
gradient-reduction function here, :func:`_make_allreduce_grads_fn`.

With a communicating compressor (``Compression.topk(0.01)``...) every gradient is compressed on its own (each
group as one vector when ``groups`` is given), keyed by its variable's name, which names its residual: the
same on every rank and at every step. tf.IndexedSlices gradients are densified first.
"""

from __future__ import annotations

import warnings

import tensorflow as tf

from perseus.runtime import guard as _guard
from perseus.runtime.process_sets import global_process_set
from perseus.base.reduce_ops import Average, ReduceOp
from perseus.compression import Reducer
from perseus.tensorflow._reduce import grouped_allreduce, reduce_with
from perseus.tensorflow.compression import Compression
from perseus.base.partition import split_list
from perseus.tensorflow.util import var_key

__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape", "_make_allreduce_grads_fn",
           "split_list"]


def _variable_name(var) -> str:
    """A variable's full name: a Keras 3 variable's ``path`` (its ``name`` is only the last part), else
    ``name`` without the ``:0`` output suffix."""
    path = getattr(var, "path", None)
    name = path if isinstance(path, str) and path else getattr(var, "name", None)
    if not isinstance(name, str) or not name:
        return ""
    return name[:-2] if name.endswith(":0") else name


def _gradient_keys(prefix, indices, variables, use_generic_names):
    """One key per gradient position in ``indices``: ``<prefix>.<variable name>`` (made unique in order of
    appearance), or ``<prefix>.grad_<i>`` without variables or with generic names."""
    keys, seen = {}, {}
    for i in indices:
        name = "" if use_generic_names or variables is None else _variable_name(variables[i])
        base = f"{prefix}.{name}" if name else f"{prefix}.grad_{i}"
        n = seen.get(base, 0)
        seen[base] = n + 1
        keys[i] = base if n == 0 else f"{base}_{n}"
    return keys


def _partition(grads, variables, groups):
    """The positions of the present (not None) gradients, split into the reduction's groups: one group
    without ``groups``; the listed variables' gradients together (each other gradient alone) for a list of
    lists of variables; else ``groups`` nearly equal parts."""
    present = [i for i, g in enumerate(grads) if g is not None]
    if groups is None:
        return [present] if present else []
    if isinstance(groups, list):
        if variables is None:
            raise ValueError("groups given as lists of variables need the variables of the gradients")
        where = {var_key(variables[i]): i for i in present}
        parts = []
        for group in groups:
            part = [where.pop(var_key(v)) for v in group if var_key(v) in where]
            if part:
                parts.append(sorted(part))
        parts.extend([i] for i in sorted(where.values()))
        return parts
    return [p for p in split_list(present, int(groups)) if p]


def _reduce_compressed(reducer, name, grads, variables, use_generic_names, groups, op, prescale, postscale,
                       process_set, local=None):
    """Reduce ``grads`` with a communicating compressor: each gradient on its own (each group as one vector
    with ``groups``), keyed ``<name>.<variable name>``; tf.IndexedSlices are densified first. ``local``: the
    compressor's local step (momentum correction) for every gradient, or None."""
    grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
    present = [i for i, g in enumerate(grads) if g is not None]
    parts = [[i] for i in present] if groups is None else _partition(grads, variables, groups)
    keys = _gradient_keys(name, present, variables, use_generic_names)
    group_keys = [keys[p[0]] if len(p) == 1 and groups is None else f"{keys[p[0]]}.group{gi}"
                  for gi, p in enumerate(parts)]
    out = list(grads)
    reduced = reduce_with(reducer, [[grads[i] for i in p] for p in parts], group_keys, op, prescale, postscale,
                          process_set, local)
    for part, rs in zip(parts, reduced):
        for i, r in zip(part, rs):
            out[i] = r
    return out


def _make_allreduce_grads_fn(name, device_dense, device_sparse, compression, sparse_as_dense, op,
                             gradient_predivide_factor, groups, process_set):
    """Return ``allreduce_grads(grads, vars=None, use_generic_names=False, local=None)`` reducing a list of
    gradients.

    None gradients stay None. With op=Average, ``gradient_predivide_factor`` f scales by 1/f before the sum
    and by f/size after it. The reduction is skipped when the process set has one rank.

    A communicating ``compression`` (a :class:`perseus.compression.Reducer`) compresses each gradient on its
    own (each group as one vector when ``groups`` is given), keyed ``<name>.<variable name>``; sparse
    gradients are densified for it. ``local`` (a :class:`perseus.compression.local_step.LocalStep`, for such
    a compressor only: ValueError otherwise) is its momentum correction: the results are then the averaged
    updates, to be applied without momentum.
    """
    op = ReduceOp(op)
    if op == Average:
        prescale, postscale = 1.0 / gradient_predivide_factor, float(gradient_predivide_factor)
    else:
        prescale = postscale = 1.0

    def allreduce_grads(grads, vars=None, use_generic_names=False, local=None):
        if local is not None and not isinstance(compression, Reducer):
            raise ValueError(f"perseus: a local step (momentum correction) needs a communicating compressor, "
                             f"not {compression!r}")
        grads = list(grads)
        if sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        if not process_set.included() or process_set.size() <= 1:
            return grads
        if isinstance(compression, Reducer):
            return _reduce_compressed(compression, name, grads, vars, use_generic_names, groups, op, prescale,
                                      postscale, process_set, local)
        out = list(grads)
        with tf.name_scope(name + "_Allreduce"):
            for gi, part in enumerate(_partition(grads, vars, groups)):
                reduced = grouped_allreduce([grads[i] for i in part], device_dense=device_dense,
                                            device_sparse=device_sparse, compression=compression, op=op,
                                            prescale_factor=prescale, postscale_factor=postscale,
                                            process_set=process_set, ignore_name_scope=use_generic_names,
                                            name=f"grad_{gi}" if use_generic_names else None)
                for i, r in zip(part, reduced):
                    out[i] = r
        return out

    return allreduce_grads


class _DistributedGradientTape:
    """Methods mixed into a subclass of the wrapped tape's class."""

    def register_local_source(self, source):
        """Exclude ``source`` from the reduction: its gradient stays local (divided by the set size when
        ``scale_local_gradients``)."""
        self._local_sources.add(var_key(source))

    def gradient(self, target, sources, output_gradients=None, use_generic_names=False,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        """The gradients of ``target`` with respect to ``sources``, reduced across the process set."""
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients=unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads)
        global_idx = [i for i, s in enumerate(flat_sources) if var_key(s) not in self._local_sources]
        reduced = self._allreduce_grads([flat_grads[i] for i in global_idx], [flat_sources[i] for i in global_idx],
                                        use_generic_names)
        out = list(flat_grads)
        for i, r in zip(global_idx, reduced):
            out[i] = r
        if self._scale_local_gradients and self._local_sources:
            n = float(self._process_set.size())
            for i, s in enumerate(flat_sources):
                g = out[i]
                if var_key(s) in self._local_sources and g is not None:
                    out[i] = tf.IndexedSlices(g.values / n, g.indices, g.dense_shape) \
                        if isinstance(g, tf.IndexedSlices) else g / n
        return tf.nest.pack_sequence_as(sources, out)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None, use_generic_names=False):
        """``(local, global)`` lists of (source, gradient) pairs, split by :meth:`register_local_source`."""
        grads = self.gradient(target, sources, output_gradients, use_generic_names)
        local, glob = [], []
        for s, g in zip(sources, grads):
            (local if var_key(s) in self._local_sources else glob).append((s, g))
        return local, glob


def DistributedGradientTape(gradtape, device_dense='', device_sparse='', compression=Compression.none,
                            sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0,
                            groups=None, process_set=global_process_set, scale_local_gradients=True):
    """Wrap ``gradtape`` so that :meth:`gradient` returns gradients reduced (default: averaged) across the
    ranks of ``process_set``, in one grouped allreduce.

    ``device_*`` are accepted for compatibility. ``gradient_predivide_factor`` (Average only) splits the
    averaging before and after the sum. ``groups`` (int or lists of variables; ``num_groups`` is its
    deprecated spelling) splits the reduction into several groups.

    ``compression``: ``Compression.none``/``fp16``/``bf16`` (a cast for the wire), or a communicating
    compressor such as ``Compression.topk(0.01)`` (docs/compression.md), which keeps a residual per gradient
    keyed by its variable's name: create it once and pass the same instance at every step (a new instance
    starts without residuals). With one, tf.IndexedSlices gradients are densified, and the reduction is not
    differentiable. The tape does not know the optimizer: nothing moves an optimizer's momentum into the
    compressor here (no momentum correction; the Keras ``DistributedOptimizer`` does it for Keras' SGD), so
    the optimizer applies its momentum to the averaged gradients.
    """
    _guard.refuse("DistributedGradientTape")
    op = ReduceOp(op)
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed",
                      DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    if groups is not None and not (isinstance(groups, list) or groups > 0):
        raise ValueError("groups should be a non-negative integer or a list of list of tf.Variable.")
    cls = type(gradtape.__class__.__name__, (_DistributedGradientTape, gradtape.__class__), {})
    kwargs = {"persistent": gradtape._persistent}
    if hasattr(gradtape, "_watch_accessed_variables"):
        kwargs["watch_accessed_variables"] = gradtape._watch_accessed_variables
    tape = cls(**kwargs)
    tape._tape = gradtape._tape
    tape._allreduce_grads = _make_allreduce_grads_fn("DistributedGradientTape", device_dense, device_sparse,
                                                     compression, sparse_as_dense, op, gradient_predivide_factor,
                                                     groups, process_set)
    tape._process_set = process_set
    tape._scale_local_gradients = scale_local_gradients
    tape._local_sources = set()
    return tape


def PartialDistributedGradientTape(gradtape, device_dense='', device_sparse='', compression=Compression.none,
                                   sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0,
                                   num_groups=0, groups=None, process_set=global_process_set, local_layers=None,
                                   scale_local_gradients=True):
    """A :func:`DistributedGradientTape` that leaves the gradients of ``local_layers`` (objects with
    ``trainable_weights``, e.g. Keras layers) unreduced."""
    if local_layers is None:
        local_layers = []
    elif hasattr(local_layers, "trainable_weights"):
        local_layers = [local_layers]
    if not all(hasattr(layer, "trainable_weights") for layer in local_layers):
        raise ValueError("All local layers must be of tf.keras.layers.Layer type.")
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set,
                                   scale_local_gradients)
    for layer in local_layers:
        for var in layer.trainable_weights:
            tape.register_local_source(var)
    return tape
