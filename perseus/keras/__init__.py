"""perseus.keras: Horovod's horovod.keras on perseus, for the stand-alone ``keras`` package (Keras 3 with the
TensorFlow backend). Change ``import horovod.keras as hvd`` to ``import perseus.keras as hvd``.

Everything is :mod:`perseus.tensorflow.keras`'s (re-exported from there), except what depends on the Keras
module or differs in Horovod: ``allreduce`` averages by default (as Horovod's ``horovod.keras.allreduce``),
``load_model``, ``DistributedEmbedding``, ``callbacks`` and ``elastic`` use the ``keras`` package, and
``Adasum`` and ``wire_bytes`` are exported too.
"""

import keras as _keras

from perseus.lifecycle.api import wire_bytes
from perseus.base.reduce_ops import Adasum
from perseus.tensorflow._keras import frontend as _frontend
from perseus.tensorflow._keras.embedding import make_embedding_class as _make_embedding_class
from perseus.tensorflow.keras import (  # noqa: F401 - re-exported
    Average, Compression, DistributedOptimizer, PartialDistributedOptimizer, ProcessSet, Sum, add_process_set,
    allgather, broadcast, broadcast_global_variables, ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
    global_process_set, gloo_built, gloo_enabled, init, is_initialized, local_rank, local_size, mpi_built,
    mpi_enabled, mpi_threads_supported, nccl_built, rank, reducescatter, remove_process_set, rocm_built, shutdown,
    size, start_timeline, stop_timeline,
)
from perseus.keras import callbacks, elastic  # noqa: E402

DistributedEmbedding = _make_embedding_class(_keras)

# perseus.tensorflow.keras's __all__, then the two names only this module exports.
__all__ = [
    "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline", "size", "local_size",
    "cross_size", "rank", "local_rank", "cross_rank", "mpi_threads_supported", "mpi_enabled", "mpi_built",
    "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "Average", "Sum",
    "Compression", "DistributedOptimizer", "PartialDistributedOptimizer", "broadcast_global_variables",
    "allreduce", "allgather", "broadcast", "reducescatter", "load_model", "callbacks", "elastic",
    "DistributedEmbedding", "Adasum", "wire_bytes",
]


def allreduce(value, name=None, average=True, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=Compression.none):
    """Reduce ``value`` (array, tensor or number) across all ranks now (default: average); a tf.Tensor, as Horovod."""
    if op is not None:
        average = None
    return _frontend.value_allreduce(value, name, average, prescale_factor, postscale_factor, op, compression)


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none,
               legacy_opts=False):
    """``keras.models.load_model`` with the saved optimizer re-created as a DistributedOptimizer.

    ``custom_optimizers`` lists optimizer classes beyond Keras' own; ``custom_objects`` is passed through.
    ``legacy_opts`` is accepted for compatibility.
    """
    return _frontend.keras_load_model(_keras, filepath, custom_optimizers, custom_objects, compression)
