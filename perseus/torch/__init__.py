"""perseus.torch: Horovod's horovod.torch API on the perseus engine.

Change ``import horovod.torch as hvd`` to ``import perseus.torch as hvd``; nothing else in the script changes.
"""

import torch

from perseus.lifecycle.api import wire_bytes
from perseus.base.exceptions import HorovodInternalError, PerseusInternalError
from perseus.torch import compression, elastic, functions, mpi_ops, optimizer
from perseus.torch.compression import Compression
from perseus.torch.device import stats as device_stats
from perseus.torch.functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                                     broadcast_parameters)
from perseus.torch.optimizer import DistributedOptimizer
from perseus.torch.embedding import DistributedEmbedding
from perseus.torch.sync_batch_norm import SyncBatchNorm
from perseus.torch.mpi_ops import (
    Adasum, Average, Max, Min, Product, ProcessSet, ReduceOp, Sum, add_process_set, allgather, allgather_async,
    allreduce, allreduce_, allreduce_async, allreduce_async_, alltoall, alltoall_async, barrier, broadcast,
    broadcast_, broadcast_async, broadcast_async_, ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
    gloo_built, gloo_enabled, global_process_set, grouped_allgather, grouped_allgather_async, grouped_allreduce,
    grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_, grouped_reducescatter,
    grouped_reducescatter_async, init, is_homogeneous, is_initialized, join, local_rank, local_size,
    mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, poll, rank, reducescatter, reducescatter_async,
    remove_process_set, rocm_built, shutdown, size, sparse_allreduce_async, start_timeline, stop_timeline,
    synchronize,
)

__all__ = [
    "Compression", "allreduce", "allreduce_async", "allreduce_", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_async", "grouped_allreduce_", "grouped_allreduce_async_", "sparse_allreduce_async",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast",
    "broadcast_async", "broadcast_", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter",
    "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async", "join", "barrier", "poll",
    "synchronize", "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline", "size",
    "local_size", "cross_size", "rank", "local_rank", "cross_rank", "is_homogeneous",
    "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built",
    "ddl_built", "ccl_built", "cuda_built", "rocm_built", "ProcessSet", "global_process_set",
    "add_process_set", "remove_process_set", "Average", "Sum", "Adasum", "Min", "Max", "Product", "ReduceOp",
    "HorovodInternalError", "PerseusInternalError", "mpi_ops", "DistributedOptimizer", "broadcast_parameters",
    "broadcast_optimizer_state", "broadcast_object", "allgather_object", "elastic", "SyncBatchNorm",
    "wire_bytes", "DistributedEmbedding", "device_stats",
]


def _check_has_gpu():
    """True when this process can hand CUDA tensors to the collectives (torch sees a GPU); they are staged
    through host memory (docs/gpu.md)."""
    return bool(torch.cuda.is_available())
