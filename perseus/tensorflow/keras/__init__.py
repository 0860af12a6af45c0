"""perseus.tensorflow.keras: Horovod's horovod.tensorflow.keras on perseus, for ``tf.keras``.

``tf.keras`` is Keras 3 in TensorFlow >= 2.16, or tf-keras 2 when ``TF_USE_LEGACY_KERAS=1`` and the
``tf-keras`` package is installed; both work. Change ``import horovod.tensorflow.keras as hvd`` to
``import perseus.tensorflow.keras as hvd``.
"""

from tensorflow import keras as _keras

from perseus.runtime.process_sets import ProcessSet, global_process_set
from perseus.lifecycle import add_process_set, remove_process_set
from perseus.base.reduce_ops import Average, Sum
from perseus.tensorflow._keras import frontend as _frontend
from perseus.tensorflow._keras.embedding import make_embedding_class as _make_embedding_class
from perseus.tensorflow.compression import Compression
from perseus.tensorflow.functions import broadcast_global_variables as _broadcast_global_variables
from perseus.tensorflow.mpi_ops import (  # noqa: F401 - re-exported
    ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, init, is_initialized,
    local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank, rocm_built,
    shutdown, size, start_timeline, stop_timeline,
)
from perseus.tensorflow.keras import callbacks, elastic  # noqa: E402

DistributedEmbedding = _make_embedding_class(_keras)

__all__ = [
    "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline", "size", "local_size",
    "cross_size", "rank", "local_rank", "cross_rank", "mpi_threads_supported", "mpi_enabled", "mpi_built",
    "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "Average", "Sum",
    "Compression", "DistributedOptimizer", "PartialDistributedOptimizer", "broadcast_global_variables",
    "allreduce", "allgather", "broadcast", "reducescatter", "load_model", "callbacks", "elastic",
    "DistributedEmbedding",
]


def DistributedOptimizer(optimizer, name=None, device_dense='', device_sparse='', compression=Compression.none,
                         sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average,
                         backward_passes_per_step=1, average_aggregated_gradients=False, num_groups=0,
                         groups=None, process_set=global_process_set, scale_local_gradients=True):
    """Wrap a Keras optimizer so that gradients are averaged (or summed) across the ranks before they are
    applied.

    Returns a new optimizer of a subclass of ``optimizer``'s class with the same name, configured from
    ``optimizer.get_config()``. ``op`` is Average, Sum or Adasum (ValueError otherwise). ``compression``
    compresses the gradients on the wire: ``Compression.fp16``/``bf16`` cast them; a communicating compressor
    (``Compression.topk(0.01)``, ``hitopk``, ``randomk``, ``sign``, ``qsgd``, ``powersgd``, ``cupcake``,
    ``espresso``: docs/compression.md) runs its own collective on each gradient (each group with
    ``groups``) and keeps its residual under the variable's name (give each optimizer its own instance;
    sparse gradients are densified for it). ``sparse_as_dense`` densifies ``tf.IndexedSlices`` gradients
    (embeddings) before the reduction; ``gradient_predivide_factor`` splits the averaging before/after the sum;
    ``backward_passes_per_step`` > 1 sums gradients locally and reduces every that many passes (divided by
    the count when ``average_aggregated_gradients``); ``groups`` splits the reduction into several groups.

    Momentum correction: with Keras' ``SGD`` (momentum in (0, 1), nesterov or not) and a compressor that takes
    the momentum (``topk``, ``randomk``, ``hitopk``, or ``cupcake`` of one of them, with error feedback), each
    rank applies the momentum to its gradient before compressing and the optimizer applies the averaged
    update without momentum. ``optimizer.momentum`` keeps its value; the optimizer's momentum slots stay zero;
    the velocities live in the compressor (not in checkpoints). ``Compression.topk(0.01,
    momentum_correction=False)`` keeps the momentum in the optimizer (applied to the averaged gradients).
    Details and exceptions: perseus/tensorflow/keras_momentum.py.

    ``op=Adasum``: the gradients are not reduced; each rank's optimizer applies its own gradients (summed locally
    over ``backward_passes_per_step`` passes) and the updates (``variable - value before the step``) are combined
    by Adasum, so every rank ends the step at ``value before + Adasum(updates)`` (docs/adasum.md). Not with
    ``groups``, a communicating compressor or an optimizer made with ``use_ema=True`` (NotImplementedError),
    nor with ``gradient_predivide_factor`` (ValueError); ``Compression.fp16``/``bf16`` apply to the updates.

    Every rank of ``process_set`` must wrap the same optimizer and train the same model. Keras 3 with the
    TensorFlow backend, or tf-keras 2; XLA-compiled steps (``jit_compile=True``) raise NotImplementedError
    (Keras 3's default ``jit_compile="auto"`` then means no XLA, even on a GPU).
    """
    return _frontend.distributed_optimizer(optimizer, name, device_dense, device_sparse, compression,
                                           sparse_as_dense, gradient_predivide_factor, op,
                                           backward_passes_per_step, average_aggregated_gradients, num_groups,
                                           groups, process_set, scale_local_gradients)


def PartialDistributedOptimizer(optimizer, name=None, device_dense='', device_sparse='',
                                compression=Compression.none, sparse_as_dense=False, gradient_predivide_factor=1.0,
                                op=Average, backward_passes_per_step=1, average_aggregated_gradients=False,
                                groups=None, process_set=global_process_set, local_layers=None,
                                scale_local_gradients=True):
    """A :func:`DistributedOptimizer` whose ``local_layers`` keep their gradients local to each rank (divided
    by the number of ranks when ``scale_local_gradients``)."""
    return _frontend.partial_distributed_optimizer(
        optimizer, local_layers, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, groups=groups, process_set=process_set,
        scale_local_gradients=scale_local_gradients)


def broadcast_global_variables(root_rank):
    """TF1 graph mode only, as in Horovod: eagerly raises RuntimeError (broadcast the model's variables with
    ``perseus.tensorflow.broadcast_variables`` or use ``callbacks.BroadcastGlobalVariablesCallback``)."""
    return _broadcast_global_variables(root_rank)


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=Compression.none):
    """Reduce ``value`` (array, tensor or number) across all ranks now (default: average); a tf.Tensor, as Horovod."""
    return _frontend.value_allreduce(value, name, average, prescale_factor, postscale_factor, op, compression)


def allgather(value, name=None):
    """Concatenate ``value`` from every rank along its first dimension; a tf.Tensor."""
    return _frontend.value_allgather(value, name)


def broadcast(value, root_rank, name=None):
    """Rank ``root_rank``'s ``value`` on every rank; a tf.Tensor."""
    return _frontend.value_broadcast(value, root_rank, name)


def reducescatter(value, name=None, op=Average):
    """Reduce ``value`` and return this rank's share of its first dimension; a tf.Tensor."""
    return _frontend.value_reducescatter(value, name, op)


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none,
               legacy_opts=False):
    """``tf.keras.models.load_model`` with the saved optimizer re-created as a DistributedOptimizer.

    ``custom_optimizers`` lists optimizer classes beyond Keras' own; ``custom_objects`` is passed through.
    ``legacy_opts`` is accepted for compatibility (legacy optimizers are registered whenever Keras has them).
    """
    return _frontend.keras_load_model(_keras, filepath, custom_optimizers, custom_objects, compression)
