"""The public functions of perseus.tensorflow.keras and perseus.keras, for a given Keras module."""

from __future__ import annotations

import warnings

from perseus.common.process_sets import global_process_set
from perseus.common.reduce_ops import Average, resolve_op
from perseus._keras.optimizer import (_Settings, check_keras_op, create_distributed_optimizer, distributed_class,
                                     load_model as _load_model)
from perseus._keras.values import allgather_value, allreduce_value, broadcast_value, reducescatter_value

__all__ = ["distributed_optimizer", "partial_distributed_optimizer", "keras_load_model", "value_allreduce",
           "value_allgather", "value_broadcast", "value_reducescatter"]


def distributed_optimizer(optimizer, name=None, device_dense='', device_sparse='', compression=None,
                          sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average,
                          backward_passes_per_step=1, average_aggregated_gradients=False, num_groups=0,
                          groups=None, process_set=global_process_set, scale_local_gradients=True):
    """See perseus.tensorflow.keras.DistributedOptimizer."""
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed",
                      DeprecationWarning, stacklevel=3)
        if groups is None:
            groups = num_groups
    return create_distributed_optimizer(optimizer, name, device_dense, device_sparse, compression,
                                        sparse_as_dense, gradient_predivide_factor, op, backward_passes_per_step,
                                        average_aggregated_gradients, groups, process_set, scale_local_gradients)


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
    :func:`perseus._keras.load_model`)."""
    from perseus.tensorflow.compression import Compression
    settings = _Settings(None, '', '', compression or Compression.none, False, 1.0, check_keras_op(Average), 1,
                         False, None, global_process_set, True)
    modules = [keras.optimizers]
    if hasattr(keras.optimizers, "legacy"):
        modules.append(keras.optimizers.legacy)
    return _load_model(keras, lambda cls: distributed_class(cls, settings), modules, filepath,
                       custom_optimizers, custom_objects)


def _tensor(array):
    """A NumPy result as an eager tf.Tensor: Horovod's Keras value collectives return tensors in eager mode."""
    import tensorflow as tf

    return tf.convert_to_tensor(array)


def value_allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
                    compression=None):
    """Reduce a value (array, tensor, number) across all ranks now; returns a tf.Tensor."""
    op = resolve_op(op, average)
    from perseus.tensorflow.compression import Compression
    if compression is not None and compression is not Compression.none:
        import tensorflow as tf
        from perseus.tensorflow import allreduce
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
