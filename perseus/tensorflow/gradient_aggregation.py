"""Local gradient aggregation for ``backward_passes_per_step > 1`` (TensorFlow tensors, eager or tf.function).

Gradients are summed into one accumulator variable per trainable variable for ``backward_passes_per_step``
passes; the pass that completes a cycle reduces the accumulated values across the ranks (divided by the number
of passes when ``average_aggregated_gradients``) and the optimizer applies them; the other passes only advance
``optimizer.iterations``. The decisions are ``tf.cond`` on a counter variable, so the same code works eagerly and
inside ``model.fit``'s compiled step. Every rank takes the same branch at the same step (the counter advances
identically), so the collectives inside the branch stay matched.
"""

from __future__ import annotations

import tensorflow as tf

from perseus.tensorflow.util import var_key

__all__ = ["LocalGradientAggregationHelper", "var_key", "is_model_parallel"]


def is_model_parallel(var) -> bool:
    """True for a variable holding a different shard on every rank (a DistributedEmbedding's table): its
    gradient is complete on each rank and is never reduced or rescaled."""
    return bool(getattr(var, "perseus_model_parallel", False))


class LocalGradientAggregationHelper:
    """Sums gradients locally and reduces them every ``backward_passes_per_step`` passes.

    Args:
        backward_passes_per_step: passes per optimizer update (>= 2).
        allreduce_func: ``f(grads, vars) -> grads`` reducing the global gradients across the ranks.
        average_aggregated_gradients: divide the accumulated gradients by ``backward_passes_per_step``.
        size_fn: the process-set size (local gradients are divided by it when ``scale_local_gradients``).
    """

    def __init__(self, backward_passes_per_step, allreduce_func, average_aggregated_gradients, size_fn,
                 scale_local_gradients=True):
        if backward_passes_per_step < 2:
            raise ValueError("backward_passes_per_step must be at least 2 for local aggregation")
        self.backward_passes_per_step = int(backward_passes_per_step)
        self._allreduce = allreduce_func
        self._average = average_aggregated_gradients
        self._size_fn = size_fn
        self._scale_local = scale_local_gradients
        self._local_vars = set()
        self.counter = None
        self._accumulators = None

    def register_local_var(self, var):
        """Keep ``var``'s gradient local (not reduced across ranks)."""
        self._local_vars.add(var_key(var))

    def _build(self, variables, grads):
        if self.counter is not None:
            return
        with tf.init_scope():
            self.counter = tf.Variable(0, dtype=tf.int32, trainable=False, name="aggregation_counter")
            self._accumulators = [
                None if g is None else tf.Variable(tf.zeros(v.shape, g.dtype), trainable=False,
                                                   name="aggregation_variable")
                for v, g in zip(variables, grads)]

    def _at_cycle_end(self):
        return tf.equal(self.counter, self.backward_passes_per_step)

    def compute_gradients(self, grads, variables, local=None):
        """Add this pass's gradients to the accumulators; return the gradients the optimizer should apply.

        At the end of a cycle these are the reduced accumulated gradients; on other passes the local sums
        (which :meth:`apply_gradients` does not apply). None gradients stay None. ``local`` (a compressor's
        momentum correction, :class:`perseus.compression.local_step.LocalStep`) is passed to the reduction
        as ``local=`` when given.
        """
        extra = {} if local is None else {"local": local}
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        variables = list(variables)
        self._build(variables, grads)
        if len(grads) != len(self._accumulators):
            raise ValueError(f"gradient aggregation was set up for {len(self._accumulators)} variables, got "
                             f"{len(grads)} gradients: pass the same variables at every step")
        present = [i for i, g in enumerate(grads) if g is not None]
        updates = [self._accumulators[i].assign_add(grads[i]) for i in present]
        with tf.control_dependencies(updates):
            bump = self.counter.assign_add(1)
        with tf.control_dependencies([bump]):
            values = [self._accumulators[i].read_value() for i in present]

        def reduced():
            vals = [v / self.backward_passes_per_step for v in values] if self._average else list(values)
            glob = [k for k, i in enumerate(present) if var_key(variables[i]) not in self._local_vars
                    and not is_model_parallel(variables[i])]
            out = list(vals)
            for k, r in zip(glob, self._allreduce([vals[k] for k in glob], [variables[present[k]] for k in glob],
                                                  **extra)):
                out[k] = r
            if self._scale_local and self._local_vars:
                size = tf.cast(self._size_fn(), vals[0].dtype) if vals else None
                for k, i in enumerate(present):
                    if var_key(variables[i]) in self._local_vars:
                        out[k] = out[k] / tf.cast(size, out[k].dtype)
            return out

        if not present:
            return list(grads)
        if tf.executing_eagerly():
            chosen = reduced() if bool(self._at_cycle_end()) else values
        else:
            chosen = tf.cond(self._at_cycle_end(), reduced, lambda: [tf.identity(v) for v in values])
        out = list(grads)
        for i, v in zip(present, chosen):
            out[i] = v
        return out

    def apply_gradients(self, apply_fn, optimizer):
        """At the end of a cycle run ``apply_fn()`` and clear the accumulators; otherwise only advance
        ``optimizer.iterations``."""
        if self.counter is None:
            raise RuntimeError("apply_gradients() was called before the gradients were computed: with "
                               "backward_passes_per_step > 1 compute them through the DistributedOptimizer")

        def apply():
            result = apply_fn()
            deps = [result] if isinstance(result, (tf.Tensor, tf.Operation)) else []
            with tf.control_dependencies(deps):
                clears = [a.assign(tf.zeros_like(a)) for a in self._accumulators if a is not None]
                clears.append(self.counter.assign(0))
            with tf.control_dependencies(clears):
                return tf.constant(True)

        def skip():
            with tf.control_dependencies([optimizer.iterations.assign_add(1)]):
                return tf.constant(False)

        if tf.executing_eagerly():
            return apply() if bool(self._at_cycle_end()) else skip()
        return tf.cond(self._at_cycle_end(), apply, skip)
