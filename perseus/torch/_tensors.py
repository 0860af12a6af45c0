"""Torch tensors as the engine sees them: dtype codes, zero-copy NumPy views, and waiting for a request.

The lowest module of perseus.torch's collectives: :mod:`perseus.torch._allreduce_ops`,
:mod:`perseus.torch._gather_ops` and the optimizer schedules build on it; :mod:`perseus.torch.mpi_ops`
re-exports :func:`poll` and :func:`synchronize`.
"""

from __future__ import annotations

import numpy as np
import torch

from perseus.runtime import collectives as _c
from perseus.engine.messages import DType
from perseus.torch.staging import Deferred as _Deferred

__all__ = ["poll", "synchronize"]


def poll(handle):
    """True when the async request ``handle`` has finished (then :func:`synchronize` returns at once).

    Raises:
        ValueError: ``handle`` is unknown (already synchronized, or never issued).
    """
    if type(handle) is _Deferred:  # a staged request the stager may not have submitted yet
        if not handle.ready.is_set():
            return False
        if handle.error is not None:  # (finished: synchronize raises the submission's error)
            return True
        handle = handle.handle
    return _c.poll(handle)


def synchronize(handle):
    """Wait for an async request and return its output; None for an unknown handle.

    Raises:
        HorovodInternalError: the collective failed (mismatch across ranks, stall, failed peer).
    """
    if type(handle) is _Deferred:  # a staged request: submitted by the stager once its copy to the host is done
        handle = handle.resolve()
    try:
        return _runtime.engine.wait(handle)
    except BaseException:
        for forget in _failed_wait_hooks:  # (perseus.torch.device: the launcher lets go of the request's tensors)
            forget(handle)
        raise


#: called with the handle when synchronize() raises
_failed_wait_hooks: list = []


_runtime = _c.runtime()


_DTYPES = {
    torch.uint8: DType.UINT8, torch.int8: DType.INT8, torch.int16: DType.INT16, torch.int32: DType.INT32,
    torch.int64: DType.INT64, torch.float16: DType.FLOAT16, torch.bfloat16: DType.BFLOAT16,
    torch.float32: DType.FLOAT32, torch.float64: DType.FLOAT64, torch.bool: DType.BOOL,
}


def _dtype(t: torch.Tensor) -> DType:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"perseus expected a torch.Tensor, got {type(t).__name__}")
    try:
        dt = _DTYPES[t.dtype]
    except KeyError:
        raise ValueError(f"Tensor type {t.type()} is not supported. perseus takes "
                         f"{', '.join(str(d).replace('torch.', '') for d in _DTYPES)} tensors; convert it "
                         "(for example with .float() or .view_as_real())") from None
    if t.layout is not torch.strided:
        raise ValueError("perseus: sparse tensors are not supported here; use sparse_allreduce_async or "
                         "sparse_as_dense=True")
    return dt


def _tensor_list(tensors, what: str) -> list:
    """``tensors`` (a list or tuple of tensors) as a list.

    Raises:
        TypeError: a single tensor (which would be split into its rows) or something not iterable.
    """
    if isinstance(tensors, torch.Tensor) or not hasattr(tensors, "__iter__"):
        raise TypeError(f"perseus.{what}: expected a list of tensors, got {type(tensors).__name__}; wrap a single "
                        f"tensor in a list")
    return list(tensors)


def _np(t: torch.Tensor) -> np.ndarray:
    """Zero-copy NumPy view of a contiguous CPU tensor (bfloat16 as uint16 words).

    Raises:
        NotImplementedError: ``t`` is not on the CPU (a path that does not stage device tensors).
    """
    if not t.is_cpu:
        raise NotImplementedError(f"perseus: this operation takes CPU tensors only, not tensors on {t.device} "
                                  "(the collectives, DistributedOptimizer and SyncBatchNorm take GPU tensors; "
                                  "the sparse embedding layers do not yet); move it to the CPU")
    t = t.detach()
    if t.dtype is torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _alloc_like(t: torch.Tensor, holder: list):
    def alloc(shape):
        out = torch.empty(shape, dtype=t.dtype)
        holder.append(out)
        return _np(out)
    return alloc

