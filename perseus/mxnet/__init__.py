"""perseus.mxnet: Horovod's horovod.mxnet API (MXNet 1.9) on the perseus engine.

Change ``import horovod.mxnet as hvd`` to ``import perseus.mxnet as hvd``; nothing else in the script
changes. Works with MXNet 1.9.1 and NumPy < 1.24 (``tools/setup_mxnet_env.sh`` builds such an environment).

Every collective returns once its result is in the output NDArray (see :mod:`perseus.mxnet.mpi_ops`); a
cross-rank mismatch raises an ``mxnet.base.MXNetError`` on every rank that is also a perseus
``MismatchError`` (a ``HorovodInternalError``).

``DistributedOptimizer`` and ``DistributedTrainer`` also take ``op=hvd.Adasum`` (a perseus addition): each
rank's own update, the ranks' updates combined with Adasum (:mod:`perseus.mxnet.adasum`).

Not implemented (raise ``NotImplementedError``): NDArrays on a GPU context (the NCCL transport), op=Adasum
in reducescatter, parameters replicated on several contexts of one process in ``DistributedTrainer``.
"""

from perseus.lifecycle.api import wire_bytes
from perseus.base.exceptions import HorovodInternalError, MismatchError, PerseusInternalError
from perseus.mxnet import compression, functions, mpi_ops, optimizer
from perseus.mxnet._bridge import PerseusMXNetInternalError, PerseusMXNetMismatchError, PerseusMXNetValueError
from perseus.mxnet.compression import Compression
from perseus.mxnet.functions import allgather_object, broadcast_object, broadcast_parameters
from perseus.mxnet.mpi_ops import (
    Adasum, Average, Max, Min, Product, ProcessSet, ReduceOp, Sum, add_process_set, allgather, allreduce,
    allreduce_, alltoall, broadcast, broadcast_, ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
    gloo_built, gloo_enabled, global_process_set, grouped_allgather, grouped_allreduce, grouped_allreduce_,
    grouped_reducescatter, handle_average_backwards_compatibility, init, is_homogeneous, is_initialized,
    local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank, reducescatter,
    remove_process_set, rocm_built, shutdown, size, start_timeline, stop_timeline,
)
from perseus.mxnet.optimizer import DistributedOptimizer, DistributedTrainer

__all__ = [
    "Compression", "allgather_object", "broadcast_object", "allgather", "grouped_allgather", "allreduce",
    "allreduce_", "grouped_allreduce", "grouped_allreduce_", "alltoall", "broadcast", "broadcast_",
    "reducescatter", "grouped_reducescatter", "init", "shutdown", "is_initialized", "start_timeline",
    "stop_timeline", "size", "local_size", "cross_size", "rank", "local_rank", "cross_rank", "is_homogeneous",
    "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built",
    "ddl_built", "ccl_built", "cuda_built", "rocm_built", "ProcessSet", "global_process_set",
    "add_process_set", "remove_process_set", "Average", "Sum", "Adasum", "Min", "Max", "Product", "ReduceOp",
    "DistributedOptimizer", "DistributedTrainer", "broadcast_parameters", "handle_average_backwards_compatibility",
    "HorovodInternalError", "PerseusInternalError", "MismatchError", "PerseusMXNetInternalError",
    "PerseusMXNetMismatchError", "PerseusMXNetValueError", "mpi_ops", "compression", "functions", "optimizer",
    "wire_bytes",
]


def _check_has_gpu():
    """False: perseus moves CPU NDArrays until the GPU transport lands."""
    return False
