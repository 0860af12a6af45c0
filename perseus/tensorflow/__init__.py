"""perseus.tensorflow: Horovod's horovod.tensorflow API (TensorFlow 2) on the perseus engine.

Change ``import horovod.tensorflow as hvd`` to ``import perseus.tensorflow as hvd``. Collectives work eagerly
and inside ``tf.function`` (through ``tf.py_function``; XLA ``jit_compile=True`` is not supported), and are
differentiable. A cross-rank mismatch raises ``tf.errors.FailedPreconditionError`` on every rank.

Not here yet: the Keras ``DistributedOptimizer`` and the TF1 ``tf.compat.v1.train.Optimizer`` wrapper
(``DistributedOptimizer`` below raises NotImplementedError), ``SyncBatchNormalization``, ``elastic``,
``broadcast_global_variables``/``BroadcastGlobalVariablesHook`` (TF1 graph mode).
"""

from perseus.common.exceptions import HorovodInternalError, PerseusInternalError
from perseus.tensorflow import compression, functions, gradient_tape, mpi_ops, util
from perseus.tensorflow._core import PerseusFailedPreconditionError, PerseusUnknownError
from perseus.tensorflow._reduce import allreduce, grouped_allreduce, grouped_reducescatter, reducescatter
from perseus.tensorflow.compression import Compression
from perseus.tensorflow.functions import allgather_object, broadcast_object, broadcast_object_fn, broadcast_variables
from perseus.tensorflow.gradient_tape import (DistributedGradientTape, PartialDistributedGradientTape,
                                              _make_allreduce_grads_fn, split_list)
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
    "allgather_object", "DistributedGradientTape", "PartialDistributedGradientTape", "DistributedOptimizer",
    "HorovodInternalError", "PerseusInternalError", "PerseusFailedPreconditionError", "PerseusUnknownError",
    "gpu_available", "split_list", "handle_average_backwards_compatibility", "check_num_rank_power_of_2",
    "mpi_ops", "util",
]


def gpu_available(ext_base_name=None, verbose=False):
    """False: perseus moves host memory until its GPU transport lands."""
    return False


def DistributedOptimizer(optimizer, *args, **kwargs):
    """Placeholder: the Keras / TF1 optimizer wrappers are a later step (perseus.tensorflow.keras)."""
    raise NotImplementedError("perseus.tensorflow.DistributedOptimizer is not implemented yet; use "
                              "perseus.tensorflow.DistributedGradientTape in a custom training loop")
