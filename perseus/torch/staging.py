"""Host staging: how torch collectives move tensors that live on a GPU.

The engine reduces host memory. A CUDA tensor handed to a collective is copied into pinned host memory
(torch's caching host allocator: the buffer is reused step after step), the engine works on that copy exactly
as on a CPU tensor, and the result is copied back to the tensor's device when the request is synchronized.

- Submission: the copy to the host runs on a side stream that first waits for the caller's current stream, so
  it reads what the tensor's producers (kernels queued before the call) wrote. The calling thread then waits
  for the copy on a blocking-sync event (sleeping, the GIL released) before the request reaches the engine.
  Later kernels on the caller's stream are not held up by the copy, and the tensor may be freed or overwritten
  as soon as the call returns.
- Completion (``synchronize``): the copy back is queued on the caller's current stream of the tensor's device,
  without a host wait: work queued after it on that stream sees the result.

The device-specific calls sit behind :class:`DeviceOps` (one object per kind of device): :class:`CudaOps` on a
GPU, :class:`HostOps` for CPU tensors when ``PERSEUS_STAGE_CPU_TENSORS=1`` asks for the same staging on CPU
tensors (plain host buffers, synchronous copies), which is how CPU-only CI runs this module.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

from perseus.common.state import runtime

__all__ = ["DeviceOps", "CudaOps", "HostOps", "wanted", "to_host", "host_empty", "to_device", "copy_back",
           "stage_cpu"]


class DeviceOps:
    """The three device operations staging needs. Every method is called on the caller's thread."""

    def host_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor to stage into (pinned where the device can copy from it asynchronously)."""
        raise NotImplementedError

    def to_host(self, host: torch.Tensor, src: torch.Tensor) -> None:
        """Fill ``host`` with ``src``'s values as ordered on the caller's stream; return when ``host`` holds them."""
        raise NotImplementedError

    def to_device(self, dst: torch.Tensor, host: torch.Tensor) -> None:
        """Queue the copy of ``host`` into ``dst`` on the caller's stream; ``host`` may be dropped at once."""
        raise NotImplementedError


class HostOps(DeviceOps):
    """CPU tensors staged like device tensors (``PERSEUS_STAGE_CPU_TENSORS=1``): every copy is synchronous."""

    def host_empty(self, shape, dtype):
        return torch.empty(shape, dtype=dtype)

    def to_host(self, host, src):
        host.copy_(src)

    def to_device(self, dst, host):
        dst.copy_(host)


class CudaOps(DeviceOps):
    """CUDA tensors: pinned host buffers, a side stream per device for the copies out, blocking-sync events."""

    def __init__(self):
        self._lock = threading.Lock()
        self._streams: dict[int, torch.cuda.Stream] = {}

    def _side(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._streams.get(index)
        if stream is None:
            with self._lock:
                stream = self._streams.get(index)
                if stream is None:
                    stream = self._streams[index] = torch.cuda.Stream(device=index)
        return stream

    def host_empty(self, shape, dtype):
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def to_host(self, host, src):
        with torch.cuda.device(src.device):
            side = self._side(src.device)
            side.wait_stream(torch.cuda.current_stream(src.device))
            with torch.cuda.stream(side):
                host.copy_(src, non_blocking=True)
                done = torch.cuda.Event(blocking=True)
                done.record(side)
        # The GIL is released while waiting; src is not touched again after this returns.
        done.synchronize()

    def to_device(self, dst, host):
        with torch.cuda.device(dst.device):
            # Pinned source: the copy is asynchronous; torch's host allocator keeps the buffer until it is done.
            dst.copy_(host, non_blocking=True)


_HOST_OPS = HostOps()
_cuda_ops: Optional[CudaOps] = None
_stage_cpu: Optional[bool] = None  # PERSEUS_STAGE_CPU_TENSORS, read at first use after each init()


def stage_cpu() -> bool:
    """Whether CPU tensors are staged too (``PERSEUS_STAGE_CPU_TENSORS``, as loaded by ``init()``)."""
    global _stage_cpu
    if _stage_cpu is None:
        _stage_cpu = bool(runtime().settings.stage_cpu_tensors)
    return _stage_cpu


def _forget() -> None:
    global _stage_cpu
    _stage_cpu = None


runtime().register_job_state(_forget)


def _ops(t: torch.Tensor) -> DeviceOps:
    global _cuda_ops
    kind = t.device.type
    if kind == "cpu":
        return _HOST_OPS
    if kind == "cuda":
        if _cuda_ops is None:
            _cuda_ops = CudaOps()
        return _cuda_ops
    raise NotImplementedError(f"perseus: tensors on {t.device} are not supported (CPU and CUDA tensors are); "
                              "move the tensor to the CPU or a CUDA device")


def wanted(t: torch.Tensor) -> bool:
    """True when ``t`` goes through host staging: it is not on the CPU, or CPU staging is on."""
    return not t.is_cpu or (_stage_cpu if _stage_cpu is not None else stage_cpu())


def host_empty(like: torch.Tensor, shape=None) -> torch.Tensor:
    """An uninitialised host tensor of ``like``'s dtype (and shape, unless ``shape`` is given) to stage into."""
    return _ops(like).host_empty(like.shape if shape is None else shape, like.dtype)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy of ``t``'s values (see the module docstring for the ordering it guarantees).

    Raises:
        NotImplementedError: ``t`` lives on a device other than the CPU or a CUDA GPU.
    """
    t = t.detach()
    ops = _ops(t)
    host = ops.host_empty(t.shape, t.dtype)
    ops.to_host(host, t)
    return host


def copy_back(dst: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """Queue the copy of the staged result ``host`` into ``dst`` (on ``dst``'s device); return ``dst``."""
    _ops(dst).to_device(dst.detach(), host)
    return dst


def to_device(host: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A new tensor on ``like``'s device holding the staged result ``host``."""
    out = torch.empty(host.shape, dtype=host.dtype, device=like.device)
    _ops(like).to_device(out, host)
    return out
