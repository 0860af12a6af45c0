"""perseus.tensorflow: Horovod's horovod.tensorflow API (TensorFlow 2) on the perseus engine.

Change ``import horovod.tensorflow as hvd`` to ``import perseus.tensorflow as hvd``. Collectives work eagerly
and inside ``tf.function`` (through ``tf.py_function``; XLA ``jit_compile=True`` is not supported), and are
differentiable. A cross-rank mismatch raises ``tf.errors.FailedPreconditionError`` on every rank.

``DistributedOptimizer`` wraps Keras optimizers (perseus.tensorflow.keras) and TF1
``tf.compat.v1.train.Optimizer`` objects; ``BroadcastGlobalVariablesHook`` serves TF1 sessions.
``SyncBatchNormalization`` is a ``tf.keras`` layer with global batch statistics.
"""

import tensorflow as tf

from perseus.tensorflow.keras2_api import (accept_compile_run_tf_function, allow_optimizer_lr,
                                       allow_optimizer_variables_call)
from perseus.lifecycle.api import wire_bytes
from perseus.base.exceptions import HorovodInternalError, PerseusInternalError
from perseus.tensorflow import compression, elastic, functions, gradient_tape, mpi_ops, util
from perseus.tensorflow._core import PerseusFailedPreconditionError, PerseusUnknownError
from perseus.tensorflow._reduce import allreduce, grouped_allreduce, grouped_reducescatter, reducescatter
from perseus.tensorflow.compression import Compression
from perseus.tensorflow.functions import (BroadcastGlobalVariablesHook, allgather_object, broadcast_global_variables,
                                          broadcast_object, broadcast_object_fn, broadcast_variables)
from perseus.tensorflow.keras_optimizer import distributed_optimizer as _keras_distributed_optimizer
from perseus.tensorflow.gradient_tape import (DistributedGradientTape, PartialDistributedGradientTape,
                                              _make_allreduce_grads_fn, split_list)
from perseus.tensorflow.legacy_optimizer import DistributedLegacyOptimizer as _DistributedLegacyOptimizer
from perseus.tensorflow.sync_batch_norm import SyncBatchNormalization
from perseus.tensorflow.mpi_ops import (
    Adasum, Average, Max, Min, Product, ProcessSet, ReduceOp, Sum, _allreduce, _check_has_gpu, _grouped_allreduce,
    _grouped_reducescatter, _reducescatter, add_process_set, allgather, alltoall, barrier, broadcast, broadcast_,
    ccl_built, check_num_rank_power_of_2, cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled,
    global_process_set, grouped_allgather, handle_average_backwards_compatibility, init, is_homogeneous,
    is_initialized, join, local_rank, local_rank_op, local_size, local_size_op, mpi_built, mpi_enabled,
    mpi_threads_supported, nccl_built, process_set_included_op, rank, rank_op, remove_process_set, rocm_built,
    shutdown, size, size_op, start_timeline, stop_timeline,
)
from perseus.tensorflow.util import _cache, _executing_eagerly, _make_subgraph, refs_to_vars, vars_to_refs

__all__ = [
    "Compression", "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "broadcast_",
    "alltoall", "reducescatter", "grouped_reducescatter", "join", "barrier", "init", "shutdown",
    "is_initialized", "start_timeline", "stop_timeline", "size", "local_size", "cross_size", "rank",
    "local_rank", "cross_rank", "is_homogeneous", "rank_op", "local_rank_op", "size_op", "local_size_op",
    "process_set_included_op", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled",
    "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "ProcessSet",
    "global_process_set", "add_process_set", "remove_process_set", "Average", "Sum", "Adasum", "Min", "Max",
    "Product", "ReduceOp", "broadcast_variables", "broadcast_object", "broadcast_object_fn",
    "allgather_object", "broadcast_global_variables", "BroadcastGlobalVariablesHook", "DistributedGradientTape",
    "PartialDistributedGradientTape",
    "DistributedOptimizer",
    "HorovodInternalError", "PerseusInternalError", "PerseusFailedPreconditionError", "PerseusUnknownError",
    "gpu_available", "split_list", "handle_average_backwards_compatibility", "check_num_rank_power_of_2",
    "mpi_ops", "util", "elastic", "SyncBatchNormalization", "wire_bytes",
]


# Horovod's TF2 examples call optimizer.variables(), compile(experimental_run_tf_function=False) and opt.lr,
# Keras 2 spellings that Keras 3 rejects.
allow_optimizer_variables_call(tf.keras)
accept_compile_run_tf_function(tf.keras)
allow_optimizer_lr(tf.keras)
util.keep_autograph_out_of_perseus()


def gpu_available(ext_base_name=None, verbose=False):
    """False: perseus moves host memory until its GPU transport lands."""
    return False


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense='', device_sparse='',
                         compression=Compression.none, sparse_as_dense=False, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=global_process_set, scale_local_gradients=True):
    """Wrap an optimizer so gradients are reduced across the ranks of ``process_set``.

    A Keras optimizer (Keras 3 or tf-keras 2) gets what :func:`perseus.tensorflow.keras.DistributedOptimizer`
    returns; unlike Horovod, ``op`` and ``groups`` are passed on rather than dropped. A TF1
    ``tf.compat.v1.train.Optimizer`` gets a TF1 optimizer whose ``compute_gradients`` reduces the gradients
    (:class:`perseus.tensorflow.legacy_optimizer.DistributedLegacyOptimizer`), for graph and session code;
    momentum correction with a sparsifying compressor is done for Keras' SGD only (a TF1 momentum optimizer
    applies its momentum to the averaged gradients).

    ``op=Adasum`` (both kinds of optimizer): the gradients are not reduced; each rank's optimizer applies its
    own gradients, and the resulting updates (``variable - value before the step``) are combined by Adasum, so
    every rank ends the step at ``value before + Adasum(updates)`` (docs/adasum.md,
    :mod:`perseus.tensorflow.adasum_optimizer`). ``Compression.fp16``/``bf16`` apply to the updates; with a
    Keras optimizer ``backward_passes_per_step`` > 1 sums the gradients locally and applies them on the last
    pass.

    Raises:
        ValueError: ``gradient_predivide_factor`` with an op other than Average; an op other than Average, Sum
            or Adasum with a Keras optimizer.
        NotImplementedError: a TF1 optimizer with ``backward_passes_per_step`` > 1 (local gradient
            aggregation is implemented for Keras optimizers only); ``op=Adasum`` with ``groups``, a
            communicating compressor (``Compression.topk``...) or a Keras optimizer made with
            ``use_ema=True``.
    """
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        if gradient_predivide_factor != 1.0 and ReduceOp(op) != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        if backward_passes_per_step > 1:
            raise NotImplementedError(
                "perseus.tensorflow.DistributedOptimizer: backward_passes_per_step > 1 is not implemented for TF1 "
                "tf.compat.v1.train.Optimizer objects; use a Keras optimizer, or accumulate gradients yourself")
        return _DistributedLegacyOptimizer(optimizer, name, use_locking, device_dense, device_sparse, compression,
                                           sparse_as_dense, op, gradient_predivide_factor,
                                           groups if groups is not None else (num_groups or None), process_set)
    return _keras_distributed_optimizer(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                                        gradient_predivide_factor, op, backward_passes_per_step,
                                        average_aggregated_gradients, num_groups, groups, process_set,
                                        scale_local_gradients)
