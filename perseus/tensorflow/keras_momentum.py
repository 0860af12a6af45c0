"""Momentum correction for the Keras DistributedOptimizer: SGD's momentum moves into a sparsifying compressor.

When the wrapped optimizer is Keras' ``SGD`` with a momentum ``0 < m < 1`` (Keras 3, tf-keras 2's new
optimizer, or tf-keras 2's ``optimizers.legacy.SGD``, with their own update rule) and the compressor takes the
momentum (:meth:`perseus.compression.Reducer.takes_momentum`: ``Compression.topk``, ``randomk``, ``hitopk`` or
``cupcake`` of one of them, with error feedback and ``momentum_correction=True``, the default), each rank
applies the momentum to its own gradient before compressing (perseus/compression/local_step.py) and the
averaged result, an *update*, is applied by a momentum-free SGD step: ``variable -= learning_rate * update``.

What the user sees: ``optimizer.momentum`` and ``optimizer.nesterov`` keep the values given (the momentum is
applied, by the compressor); the optimizer's momentum slots are still created but stay untouched (zero); the
velocities live in the compressor, next to its residuals, and are not saved in checkpoints. The momentum is
read when the step is built (each call eagerly; once per trace in ``model.fit``), as Keras itself reads it.
Keras 3's and tf-keras' new optimizers' weight decay is decoupled (applied to the variables, not through the
momentum) and stays in the optimizer; ``clipnorm``/``clipvalue``/``global_clipnorm`` clip the averaged update.

It does not engage (the optimizer applies its momentum to the averaged gradient, as before) when: the process
set has a single rank; gradients of registered local variables or model-parallel variables are applied by the
same optimizer; Keras 3's ``gradient_accumulation_steps`` is set; the momentum is not a number known when the
step is built. With tf-keras 2 it engages for gradients computed by the optimizer (``minimize``, ``model.fit``,
``compute_gradients``, ``get_gradients``): ``apply_gradients`` of other gradients applies the momentum itself.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import tensorflow as tf

from perseus.compression import Reducer
from perseus.compression.local_step import LocalStep

__all__ = ["sgd_kind", "plain_sgd_mixin", "momentum_of", "masking_of", "local_step_for", "plain_step"]

#: the method of each Keras SGD generation that holds its update rule
_RULE = {"keras3": "update_step", "keras2": "update_step", "legacy": "_resource_apply_dense"}


def sgd_kind(cls, keras3: bool) -> Optional[str]:
    """'keras3', 'keras2' (tf-keras' new optimizer) or 'legacy' (tf-keras' ``optimizers.legacy.SGD``) when
    ``cls`` is Keras' SGD or a subclass that keeps SGD's update rule; None otherwise."""
    base = next((k for k in cls.__mro__ if k.__name__ == "SGD"
                 and k.__module__.split(".")[0] in ("keras", "tf_keras")), None)
    if base is None:
        return None
    if keras3:
        kind = "keras3"
    elif "update_step" in base.__dict__:
        kind = "keras2"
    elif "_resource_apply_dense" in base.__dict__:
        kind = "legacy"
    else:
        return None
    rule = _RULE[kind]
    return kind if getattr(cls, rule, None) is base.__dict__[rule] else None


def momentum_of(opt, kind: str) -> Optional[float]:
    """The optimizer's momentum as a float, or None when it is not a number known now (a schedule, or a
    variable that cannot be read eagerly here)."""
    value = opt._hyper.get("momentum") if kind == "legacy" else getattr(opt, "momentum", None)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, tf.Variable):
        with tf.init_scope():
            if tf.executing_eagerly():
                return float(value.numpy())
    return None


def masking_of(compression) -> bool:
    """Whether the compressor that runs the local step masks the momentum (``cupcake``'s inner compressor
    does the work)."""
    inner = getattr(compression, "inner", None)
    masking = getattr(inner if isinstance(inner, Reducer) else compression, "momentum_masking", None)
    return True if masking is None else bool(masking)  # None: the default for SGD, on


def local_step_for(opt, kind: Optional[str], compression, process_set) -> Optional[LocalStep]:
    """The :class:`LocalStep` the compressor applies for optimizer ``opt`` (see the module docstring for when),
    or None: the optimizer then applies its own momentum."""
    if kind is None or not isinstance(compression, Reducer) or not compression.takes_momentum():
        return None
    if not process_set.included() or process_set.size() <= 1:
        return None
    if getattr(opt, "gradient_accumulation_steps", None):
        return None
    m = momentum_of(opt, kind)
    if m is None or not 0.0 < m < 1.0:
        return None
    return LocalStep(m, bool(getattr(opt, "nesterov", False)), masking=masking_of(compression))


@contextmanager
def plain_step(opt, on: bool):
    """While active (``on``), ``opt``'s SGD update is momentum-free (see :func:`plain_sgd_mixin`); tf-keras'
    new optimizer also skips XLA, whose compiled update would keep the rule it was first traced with."""
    if not on:
        yield
        return
    saved_jit = opt.__dict__.get("jit_compile")
    opt._perseus_plain = True
    if saved_jit:
        opt.jit_compile = False
    try:
        yield
    finally:
        opt._perseus_plain = False
        if saved_jit:
            opt.jit_compile = saved_jit


class _Keras3PlainSGD:
    """Keras 3 SGD whose update is ``variable -= learning_rate * gradient`` under :func:`plain_step`."""

    _perseus_plain = False

    def update_step(self, gradient, variable, learning_rate):
        if not self._perseus_plain:
            return super().update_step(gradient, variable, learning_rate)
        lr = tf.cast(learning_rate, variable.dtype)
        self.assign_sub(variable, tf.cast(gradient, variable.dtype) * lr)
        return None


class _Keras2PlainSGD:
    """tf-keras 2 new-optimizer SGD whose update is momentum-free under :func:`plain_step`."""

    _perseus_plain = False

    def update_step(self, gradient, variable):
        if not self._perseus_plain:
            return super().update_step(gradient, variable)
        lr = tf.cast(self.learning_rate, variable.dtype)
        if isinstance(gradient, tf.IndexedSlices):
            return variable.scatter_sub(tf.IndexedSlices(gradient.values * lr, gradient.indices))
        return variable.assign_sub(tf.cast(gradient, variable.dtype) * lr)


class _LegacyPlainSGD:
    """tf-keras 2 ``optimizers.legacy.SGD`` whose dense update is plain gradient descent under
    :func:`plain_step` (the compressor's results are dense)."""

    _perseus_plain = False

    def _resource_apply_dense(self, grad, var, apply_state=None):
        if not self._perseus_plain:
            return super()._resource_apply_dense(grad, var, apply_state)
        saved = self._momentum
        self._momentum = False
        try:
            return super()._resource_apply_dense(grad, var, apply_state)
        finally:
            self._momentum = saved


_MIXINS = {"keras3": _Keras3PlainSGD, "keras2": _Keras2PlainSGD, "legacy": _LegacyPlainSGD}


def plain_sgd_mixin(kind: Optional[str]):
    """The class to put before the SGD class of ``kind`` (None: none) so that :func:`plain_step` works."""
    return _MIXINS.get(kind) if kind else None
