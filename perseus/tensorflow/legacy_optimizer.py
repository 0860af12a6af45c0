"""DistributedOptimizer for TF1 ``tf.compat.v1.train.Optimizer`` objects (graph or eager, session-based code).

The wrapper is itself a ``tf.compat.v1.train.Optimizer``: ``compute_gradients`` asks the wrapped optimizer
for its gradients and reduces them across the ranks of the process set (the reduction the Keras optimizer and
``DistributedGradientTape`` use); ``apply_gradients`` and everything else goes to the wrapped optimizer, so
``minimize()``, slots and checkpoints behave as before.

With ``op=Adasum`` the gradients stay local instead, and ``apply_gradients`` combines every rank's update
(:mod:`perseus.tensorflow.adasum_optimizer`).
"""

from __future__ import annotations

import tensorflow as tf

from perseus.base.reduce_ops import Adasum, ReduceOp
from perseus.tensorflow.adasum_optimizer import apply_adasum, check_adasum_options, local_gradients_fn
from perseus.tensorflow.gradient_tape import _make_allreduce_grads_fn

__all__ = ["DistributedLegacyOptimizer"]


class DistributedLegacyOptimizer(tf.compat.v1.train.Optimizer):
    """A TF1 optimizer whose ``compute_gradients`` returns gradients reduced across the ranks; with
    ``op=Adasum``, one whose ``compute_gradients`` leaves them local and whose ``apply_gradients`` sets each
    variable to its value before the step plus the Adasum of every rank's update.

    Every rank of the process set must call ``compute_gradients`` and ``apply_gradients`` (or ``minimize``)
    the same number of times; ranks outside the set get their own gradients back unchanged and apply them
    alone.

    Raises (on construction, op=Adasum): NotImplementedError for a communicating compressor or ``groups``;
    ValueError for ``gradient_predivide_factor`` other than 1.
    """

    def __init__(self, optimizer, name, use_locking, device_dense, device_sparse, compression, sparse_as_dense,
                 op, gradient_predivide_factor, groups, process_set):
        self._optimizer = optimizer
        self._process_set = process_set
        self._compression = compression
        self._adasum = ReduceOp(op) == Adasum
        if self._adasum:
            check_adasum_options(compression, groups, gradient_predivide_factor)
            self._allreduce_grads = local_gradients_fn(sparse_as_dense)
        else:
            self._allreduce_grads = _make_allreduce_grads_fn(name or "DistributedOptimizer", device_dense,
                                                             device_sparse, compression, sparse_as_dense, op,
                                                             gradient_predivide_factor, groups, process_set)
        super().__init__(name=name or f"Distributed{type(optimizer).__name__}", use_locking=use_locking)

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's ``(gradient, variable)`` pairs with the gradients reduced across the
        ranks (None gradients stay None; with op=Adasum the gradients stay local). Collective, except with
        op=Adasum."""
        pairs = list(self._optimizer.compute_gradients(*args, **kwargs))
        if not pairs:
            return pairs
        grads, variables = zip(*pairs)
        return list(zip(self._allreduce_grads(list(grads), list(variables)), variables))

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        """The wrapped optimizer's ``apply_gradients``. With op=Adasum, every rank's update of the variables
        of ``grads_and_vars`` is then combined by Adasum (collective: every rank of the process set calls it
        with the same variables); a TF1 graph gets one op for the whole step."""
        if not self._adasum:
            return self._optimizer.apply_gradients(grads_and_vars, *args, **kwargs)
        pairs = list(grads_and_vars)
        return apply_adasum(lambda: self._optimizer.apply_gradients(pairs, *args, **kwargs),
                            [v for _, v in pairs], self._compression, self._process_set, self.get_name())

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)
