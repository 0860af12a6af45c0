"""DistributedOptimizer for TF1 ``tf.compat.v1.train.Optimizer`` objects (graph or eager, session-based code).

The wrapper is itself a ``tf.compat.v1.train.Optimizer``: ``compute_gradients`` asks the wrapped optimizer
for its gradients and reduces them across the ranks of the process set (the reduction the Keras optimizer and
``DistributedGradientTape`` use); ``apply_gradients`` and everything else goes to the wrapped optimizer, so
``minimize()``, slots and checkpoints behave as before.
"""

from __future__ import annotations

import tensorflow as tf

from perseus.tensorflow.gradient_tape import _make_allreduce_grads_fn

__all__ = ["DistributedLegacyOptimizer"]


class DistributedLegacyOptimizer(tf.compat.v1.train.Optimizer):
    """A TF1 optimizer whose ``compute_gradients`` returns gradients reduced across the ranks.

    Every rank of the process set must call ``compute_gradients`` (or ``minimize``) the same number of times;
    ranks outside the set get their own gradients back unchanged.
    """

    def __init__(self, optimizer, name, use_locking, device_dense, device_sparse, compression, sparse_as_dense,
                 op, gradient_predivide_factor, groups, process_set):
        self._optimizer = optimizer
        self._process_set = process_set
        self._allreduce_grads = _make_allreduce_grads_fn(name or "DistributedOptimizer", device_dense,
                                                         device_sparse, compression, sparse_as_dense, op,
                                                         gradient_predivide_factor, groups, process_set)
        super().__init__(name=name or f"Distributed{type(optimizer).__name__}", use_locking=use_locking)

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's ``(gradient, variable)`` pairs with the gradients reduced across the
        ranks (None gradients stay None)."""
        pairs = list(self._optimizer.compute_gradients(*args, **kwargs))
        if not pairs:
            return pairs
        grads, variables = zip(*pairs)
        return list(zip(self._allreduce_grads(list(grads), list(variables)), variables))

    def apply_gradients(self, *args, **kwargs):
        return self._optimizer.apply_gradients(*args, **kwargs)

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)
