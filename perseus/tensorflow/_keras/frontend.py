"""The public functions of perseus.tensorflow.keras and perseus.keras, for a given Keras module."""

from __future__ import annotations

import tensorflow as tf

from perseus.runtime.process_sets import global_process_set
from perseus.base.reduce_ops import Average, resolve_op
from perseus.tensorflow.keras_values import allgather_value, allreduce_value, broadcast_value, reducescatter_value
from perseus.tensorflow._reduce import allreduce
from perseus.tensorflow.compression import Compression
from perseus.tensorflow.keras_optimizer import (_Settings, check_keras_op, distributed_class, distributed_optimizer,
                                                load_model as _load_model)

__all__ = ["distributed_optimizer", "partial_distributed_optimizer", "keras_load_model", "value_allreduce",
           "value_allgather", "value_broadcast", "value_reducescatter"]


def partial_distributed_optimizer(optimizer, local_layers=None, **kwargs):
    """A DistributedOptimizer that keeps the gradients of ``local_layers`` (layers or a layer) local."""
    if local_layers is None:
        local_layers = []
    elif hasattr(local_layers, "trainable_weights"):
        local_layers = [local_layers]
    if not all(hasattr(layer, "trainable_weights") for layer in local_layers):
        raise ValueError("All local layers must be Keras layers (objects with trainable_weights).")
    opt = distributed_optimizer(optimizer, **kwargs)
    for layer in local_layers:
        for var in layer.trainable_weights:
            opt.register_local_var(var)
    return opt


def keras_load_model(keras, filepath, custom_optimizers=None, custom_objects=None, compression=None):
    """Load a saved Keras model whose optimizer comes back as a DistributedOptimizer (see
    :func:`perseus.tensorflow.keras_optimizer.load_model`)."""
    settings = _Settings(None, '', '', compression or Compression.none, False, 1.0, check_keras_op(Average), 1,
                         False, None, global_process_set, True)
    modules = [keras.optimizers]
    if hasattr(keras.optimizers, "legacy"):
        modules.append(keras.optimizers.legacy)
    return _load_model(keras, lambda cls: distributed_class(cls, settings), modules, filepath,
                       custom_optimizers, custom_objects)


def _tensor(array):
    """A NumPy result as an eager tf.Tensor: Horovod's Keras value collectives return tensors in eager mode."""
    return tf.convert_to_tensor(array)


def value_allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
                    compression=None):
    """Reduce a value (array, tensor, number) across all ranks now; returns a tf.Tensor."""
    op = resolve_op(op, average)
    if compression is not None and compression is not Compression.none:
        return allreduce(tf.convert_to_tensor(value), name=name, op=op, prescale_factor=prescale_factor,
                         postscale_factor=postscale_factor, compression=compression)
    return _tensor(allreduce_value(value, name, op, prescale_factor, postscale_factor))


def value_allgather(value, name=None):
    """Concatenate a value from every rank along the first dimension; returns a tf.Tensor."""
    return _tensor(allgather_value(value, name))


def value_broadcast(value, root_rank, name=None):
    """Return rank ``root_rank``'s value on every rank; a tf.Tensor."""
    return _tensor(broadcast_value(value, root_rank, name))


def value_reducescatter(value, name=None, op=Average):
    """Reduce a value and return this rank's share of the first dimension; a tf.Tensor."""
    return _tensor(reducescatter_value(value, name, op))
