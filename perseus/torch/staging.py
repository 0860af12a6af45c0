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
- All-reduces (the gradient path) do not wait for the copy out on the calling thread (the autograd thread, in a
  backward hook): the copy is queued, the caller's stream waits for it (so the input may still be overwritten
  by work queued after the call), and the request goes to the engine from the stager thread once the copy has
  finished (:func:`defer`). The caller gets a :class:`Deferred` handle, which ``synchronize`` and ``poll``
  take like an engine handle; an error of the submission (a bad argument, a name in flight) is raised by
  ``synchronize``. Requests reach the engine in the order of the calls.

The device-specific calls sit behind :class:`DeviceOps` (one object per kind of device): :class:`CudaOps` on a
GPU, :class:`HostOps` for CPU tensors when ``PERSEUS_STAGE_CPU_TENSORS=1`` asks for the same staging on CPU
tensors (plain host buffers, synchronous copies), which is how CPU-only CI runs this module.
"""

from __future__ import annotations

import queue
import threading
from typing import Optional

import torch

from perseus.runtime.state import runtime

__all__ = ["DeviceOps", "CudaOps", "HostOps", "Deferred", "wanted", "to_host", "to_host_queued", "defer", "drain",
           "host_empty", "to_device", "copy_back", "stage_cpu"]


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

    def to_host_queued(self, host: torch.Tensor, src: torch.Tensor):
        """Queue the copy of ``src`` (as ordered on the caller's stream) into ``host`` and return a token for
        :meth:`wait_copied` (None: ``host`` holds the values already). ``src`` must stay alive until then."""
        self.to_host(host, src)
        return None

    def wait_copied(self, token) -> None:
        """On the stager thread: return once the copy behind ``token`` has finished (GIL released)."""


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

    def _copy_out(self, host, src):
        """Queue the copy of ``src`` into ``host`` on the device's side stream, after the work queued on the
        caller's stream; return its (blocking-sync) done event and the side stream."""
        with torch.cuda.device(src.device):
            side = self._side(src.device)
            side.wait_stream(torch.cuda.current_stream(src.device))
            with torch.cuda.stream(side):
                host.copy_(src, non_blocking=True)
                done = torch.cuda.Event(blocking=True)
                done.record(side)
        return done, side

    def to_host(self, host, src):
        done, _ = self._copy_out(host, src)
        # The GIL is released while waiting; src is not touched again after this returns.
        done.synchronize()

    def to_host_queued(self, host, src):
        done, side = self._copy_out(host, src)
        # Work the caller queues from now on (which may overwrite src) comes after the copy: a stream wait, not
        # a host wait.
        torch.cuda.current_stream(src.device).wait_event(done)
        src.record_stream(side)  # its memory is not reused before the copy has read it
        return done

    def wait_copied(self, token):
        token.synchronize()

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
    _close_stager()


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


# -- the stager: staged requests reach the engine once their copy to the host has finished ---------------
def to_host_queued(t: torch.Tensor):
    """``(host copy, token)``: the copy of ``t``'s values into a new host tensor is queued (see
    :meth:`DeviceOps.to_host_queued`); pass the token to :func:`defer`.

    Raises:
        NotImplementedError: ``t`` lives on a device other than the CPU or a CUDA GPU.
    """
    t = t.detach()
    ops = _ops(t)
    host = ops.host_empty(t.shape, t.dtype)
    return host, (ops, ops.to_host_queued(host, t), t)


class Deferred:
    """The handle of a staged request whose copy to the host may still be under way. ``synchronize`` and
    ``poll`` take it as they take an engine handle (perseus.torch._tensors)."""

    __slots__ = ("ready", "handle", "error")

    def __init__(self):
        self.ready = threading.Event()
        self.handle = None
        self.error: Optional[BaseException] = None

    def resolve(self) -> int:
        """The engine handle, once the stager has submitted the request (waiting for that).

        Raises:
            the submission's error (ValueError for a name in flight, ...).
        """
        while not self.ready.wait(0.1):  # in slices: signal handlers (Ctrl-C, test timeouts) run meanwhile
            pass
        if self.error is not None:
            raise self.error
        return self.handle


class _Stager:
    """One thread per job: takes (copies, submission) in call order, waits for the copies, submits."""

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="perseus-stager", daemon=True)
        self._thread.start()

    def put(self, copies, submit) -> Deferred:
        deferred = Deferred()
        self._queue.put((copies, submit, deferred))
        return deferred

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            copies, submit, deferred = item
            if submit is None:  # drain()'s marker: everything before it is submitted
                deferred.ready.set()
                continue
            try:
                for ops, token, _src in copies:
                    if token is not None:
                        ops.wait_copied(token)
                del copies  # the sources may go now
                deferred.handle = submit()
            except BaseException as exc:  # noqa: BLE001 - raised by synchronize, on the caller's thread
                deferred.error = exc
            deferred.ready.set()

    def drain(self) -> None:
        """Return once every request queued so far has been submitted (or has failed to be)."""
        marker = Deferred()
        self._queue.put(((), None, marker))
        marker.resolve()

    def close(self) -> None:
        """Stop once what is queued has been dealt with (at shutdown: the engine has stopped, so submissions
        still queued fail, and their handles raise at synchronize)."""
        self._queue.put(None)
        self._thread.join(30.0)


_stager: Optional[_Stager] = None
_stager_lock = threading.Lock()


def defer(copies, submit):
    """``submit()`` (which submits a request reading the host copies, and returns its engine handle) once every
    copy of ``copies`` (the tokens of :func:`to_host_queued`) has finished, from the stager thread; returns a
    :class:`Deferred` for it, or ``submit()``'s handle at once when every copy has finished already."""
    if all(token is None for _, token, _ in copies):
        return submit()
    global _stager
    stager = _stager
    if stager is None:
        with _stager_lock:
            if _stager is None:
                _stager = _Stager()
            stager = _stager
    return stager.put(copies, submit)


def drain() -> None:
    """Return once every staged request queued by this process has reached the engine (``join()`` calls it: a
    request must not reach the engine after its rank has joined)."""
    stager = _stager
    if stager is not None:
        stager.drain()


def _close_stager() -> None:
    global _stager
    stager, _stager = _stager, None
    if stager is not None:
        stager.close()
