"""SyncBatchNormalization: Keras batch normalization whose batch statistics cover every rank's batch.

Each rank sums its (masked) inputs, squared inputs and element count over the reduction axes; one fused
float64 Sum allreduce of the three gives the global mean and variance. The allreduce is differentiable (its
gradient is the Sum allreduce of the upstream gradient), so the backward pass is synchronized too. Works with
``tf.keras`` as Keras 3 (overrides ``_moments``) and as tf-keras 2 (overrides ``_calculate_mean_and_var``).
Every rank must call the layer in training mode at the same steps.
"""

from __future__ import annotations

import tensorflow as tf

from perseus.runtime.process_sets import global_process_set
from perseus.base.reduce_ops import Sum
from perseus.tensorflow.mpi_ops import _allreduce

__all__ = ["SyncBatchNormalization"]

_Base = tf.keras.layers.BatchNormalization
_KERAS3 = not hasattr(_Base, "_calculate_mean_and_var")


def _global_moments(inputs, axes, keep_dims, mask=None, process_set=global_process_set):
    """Mean and variance of ``inputs`` over ``axes`` and over every rank's batch (float64 sums)."""
    x = tf.cast(inputs, tf.float64)
    if mask is None:
        weights = tf.ones_like(x)
    else:
        weights = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(x)), tf.float64)
    count = tf.reduce_sum(weights, axis=axes, keepdims=True)
    total = tf.reduce_sum(x * weights, axis=axes, keepdims=True)
    squares = tf.reduce_sum(x * x * weights, axis=axes, keepdims=True)
    stacked = _allreduce(tf.stack([count, total, squares]), op=Sum, process_set=process_set)
    count = tf.maximum(stacked[0], 1.0)
    mean = stacked[1] / count
    variance = tf.maximum(stacked[2] / count - mean * mean, 0.0)
    if not keep_dims:
        mean, variance = tf.squeeze(mean, axes), tf.squeeze(variance, axes)
    return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)


class SyncBatchNormalization(_Base):
    """``tf.keras.layers.BatchNormalization`` with statistics over the global batch (all ranks).

    Takes BatchNormalization's arguments. ``fused`` must be False or None (the fused kernel computes local
    statistics); ``synchronized`` (Keras' tf.distribute synchronisation) is not used.
    """

    def __init__(self, fused=False, **kwargs):
        if fused:
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        kwargs.pop("synchronized", None)
        if not _KERAS3:
            kwargs["fused"] = False
        super().__init__(**kwargs)

    if _KERAS3:
        def _moments(self, inputs, mask):
            return _global_moments(inputs, self._reduction_axes, False, mask)
    else:
        def _calculate_mean_and_var(self, inputs, reduction_axes, keep_dims, mask=None):
            return _global_moments(inputs, reduction_axes, keep_dims, mask)
