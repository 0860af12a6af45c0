"""PyTorch collectives: the surface of horovod.torch.mpi_ops.

Setup, topology and build information come from :mod:`perseus.lifecycle.api`; the allreduces from
:mod:`perseus.torch._allreduce_ops`, the other collectives from :mod:`perseus.torch._gather_ops`, waiting
from :mod:`perseus.torch._tensors`. This module only gathers them (and answers what torch is built with).
"""

from __future__ import annotations

import torch

from perseus.lifecycle.api import (  # noqa: F401 - re-exported
    _basics, ccl_built, cross_rank, cross_size, ddl_built, gloo_built, gloo_enabled, init,
    is_homogeneous, is_initialized, local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported,
    rank, rocm_built, shutdown, size, start_timeline, stop_timeline,
)
from perseus.base.exceptions import HorovodInternalError
from perseus.runtime.process_sets import ProcessSet, global_process_set
from perseus.lifecycle import add_process_set, remove_process_set
from perseus.base.reduce_ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from perseus.torch._allreduce_ops import (
    allreduce, allreduce_, allreduce_async, allreduce_async_, grouped_allreduce, grouped_allreduce_,
    grouped_allreduce_async, grouped_allreduce_async_, sparse_allreduce_async,
)
from perseus.torch._gather_ops import (
    allgather, allgather_async, alltoall, alltoall_async, barrier, broadcast, broadcast_, broadcast_async,
    broadcast_async_, grouped_allgather, grouped_allgather_async, grouped_reducescatter,
    grouped_reducescatter_async, join, reducescatter, reducescatter_async,
)
from perseus.torch._tensors import _runtime, poll, synchronize  # noqa: F401 - _runtime: for tests

__all__ = [
    "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline", "size", "local_size",
    "cross_size", "rank", "local_rank", "cross_rank", "is_homogeneous", "mpi_threads_supported",
    "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
    "cuda_built", "rocm_built", "Average", "Sum", "Adasum", "Min", "Max", "Product", "ReduceOp",
    "allreduce", "allreduce_async", "allreduce_", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_async", "grouped_allreduce_", "grouped_allreduce_async_", "sparse_allreduce_async",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast",
    "broadcast_async", "broadcast_", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter",
    "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async", "join", "barrier", "poll",
    "synchronize", "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "HorovodInternalError",
]


def cuda_built() -> bool:
    """True when this torch is built with CUDA: perseus.torch then accepts CUDA tensors in every collective and
    in DistributedOptimizer (all-reduces through NCCL when nccl_built(), the rest staged through host memory)."""
    return bool(torch.backends.cuda.is_built())


def nccl_built() -> int:
    """NCCL's version code (major * 10000 + minor * 100 + patch) when this torch carries NCCL, which perseus
    then uses for all-reduces of CUDA tensors; 0 otherwise."""
    if not (torch.distributed.is_available() and torch.distributed.is_nccl_available()):
        return 0
    major, minor, patch = torch.cuda.nccl.version()[:3]
    return major * 10000 + minor * 100 + patch
