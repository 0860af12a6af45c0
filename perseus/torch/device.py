"""The device transport for torch: collectives of GPU tensors with NCCL, planned by the engine.

The engine negotiates and fuses device requests like any other (every rank gets the same units in the same
order) but does not move their data: it hands each unit to this module's launcher thread (one per process),
which moves it with a torch.distributed backend and gives the unit back. All-reduces are packed and bucketed
here; broadcast, allgather, alltoall and reducescatter run one request a unit (submitted by
:mod:`perseus.torch.device_collectives`, run by :mod:`perseus.torch.device_ops`). What NCCL cannot do (Adasum,
int16, integer averages, sparse and compressed paths) is staged through host memory (:mod:`perseus.torch.staging`).

- Process groups: ``PERSEUS_NUM_NCCL_STREAMS`` (horovodrun's ``--num-nccl-streams``) per process set, each with
  its own NCCL communicator and stream; unit k goes to group k modulo their number. They are built over
  perseus's own ranks at the set's first device unit: its first rank starts a ``TCPStore`` on a free port and
  broadcasts the address with a perseus broadcast; each group gets a prefix of that store. The user's
  default process group is never touched.
- The launcher thread takes units in order. For each: its stream waits for the events recorded on the
  callers' streams at submission, packs the pieces into the group's fusion buffer (or reduces a lone tensor
  in place), prescales, all-reduces with SUM (or MIN/MAX/PRODUCT), postscales, unpacks, and records a done
  event.
- Completion is stream-ordered on a GPU: the unit's requests complete as soon as its work is queued, and
  ``synchronize`` makes the caller's current stream wait for the done event (no host wait); a finalizer thread
  keeps the unit's tensors referenced until the event has completed. In host memory (Gloo) the finalizer
  waits for the collective, unpacks, and then completes the requests.
- Failure: an error in the launcher fails the unit's requests on every rank (the engine's abort, naming the
  tensors); NCCL groups are aborted. A device error found after a unit completed fails every later unit.
  Group timeouts exceed perseus's stall shutdown time.
- ``PERSEUS_DEVICE_BACKEND=gloo`` runs this very launcher on CPU tensors with ``ProcessGroupGloo`` (the stream
  calls are no-ops there), which is how CPU-only CI tests it.

This module holds the backend selection (which requests take the launcher), the submission of all-reduces, and
the launcher's lifetime and counters; the launcher itself is :mod:`perseus.torch.device_launcher`, its process
groups :mod:`perseus.torch.device_groups` and the stream shim :mod:`perseus.torch.device_streams`.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

from perseus.runtime import collectives as _c
from perseus.runtime.state import runtime
from perseus.runtime.process_sets import global_process_set
from perseus.torch import _tensors
from perseus.torch.device_groups import _AVERAGE, _CPU, _CUDA, _MAX, _MIN, _PRODUCT, _SUM, CALIBRATION_LAUNCHES
from perseus.torch.device_launcher import _ALLREDUCE, _Launcher
from perseus.torch.device_streams import CudaStreams, HostStreams, Streams

__all__ = ["backend", "routes_cpu", "takes", "allreduce_async", "stats", "Streams", "CudaStreams", "HostStreams",
           "CALIBRATION_LAUNCHES"]

_runtime = runtime()

# What NCCL (and gloo) reduce: the engine's dtype codes.
_FLOATS = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
_INTS = {torch.uint8, torch.int8, torch.int32, torch.int64}


# -- which requests take this path -------------------------------------------------------------------------
def backend() -> str:
    """The settings' ``device_backend`` (auto, nccl, stage or gloo)."""
    return _runtime.settings.device_backend


_gloo: Optional[bool] = None  # PERSEUS_DEVICE_BACKEND=gloo, read at first use after each init()


def routes_cpu() -> bool:
    """Whether CPU tensors' all-reduces go through the launcher (``PERSEUS_DEVICE_BACKEND=gloo``)."""
    global _gloo
    if _gloo is None:
        _gloo = backend() == "gloo"
    return _gloo


def takes(tensors, op: int, prescale_factor: float, postscale_factor: float) -> bool:
    """True when an allreduce of ``tensors`` goes through the launcher (else it is staged or runs on the CPU):
    CUDA tensors with NCCL (unless ``PERSEUS_DEVICE_BACKEND=stage``), CPU tensors with ``gloo``; all on one
    device, of a dtype and op NCCL reduces (integers: Sum, Min, Max, Product, unscaled).

    Raises:
        ValueError: ``PERSEUS_DEVICE_BACKEND=nccl`` and this torch has no NCCL.
    """
    first = tensors[0]
    if first.is_cuda:
        if not _use_nccl():
            return False
    elif not (first.is_cpu and routes_cpu()):
        return False
    if any(t.device != first.device for t in tensors):
        return False
    scaled = prescale_factor != 1.0 or postscale_factor != 1.0
    for t in tensors:
        if t.dtype in _FLOATS:
            if op not in (_SUM, _AVERAGE, _MIN, _MAX, _PRODUCT):
                return False
        elif t.dtype not in _INTS or op not in (_SUM, _MIN, _MAX, _PRODUCT) or scaled:
            return False
    return True


_nccl: Optional[bool] = None  # CUDA all-reduces take NCCL (resolved at first use after each init())


def _use_nccl() -> bool:
    global _nccl
    if _nccl is None:
        mode = backend()
        available = torch.distributed.is_available() and torch.distributed.is_nccl_available()
        if mode == "nccl" and not available:
            raise ValueError("PERSEUS_DEVICE_BACKEND=nccl, but this torch has no NCCL; use 'auto' or 'stage'")
        _nccl = available and mode != "stage"
    return _nccl


# -- submission (caller's thread) --------------------------------------------------------------------------
class _Entry:
    __slots__ = ("input", "output", "ready", "numel", "moved", "handle", "done")

    def __init__(self, inp, out, ready):
        self.input, self.output, self.ready = inp, out, ready
        self.numel, self.moved, self.handle = out.numel(), 0, -1
        self.done = []  # stream-ordered completion: the done tokens of the units that carried it


def caller_wait(streams: Streams, entries) -> None:
    """At ``synchronize`` of a stream-ordered request: the caller's stream waits for every unit that carried
    one of ``entries``."""
    for e in entries:
        for token in e.done:
            streams.caller_wait(token)


def allreduce_async(inputs, outputs, dtypes, name, op, prescale_factor, postscale_factor, process_set, finish,
                    single: bool) -> int:
    """Start an allreduce of ``inputs`` into ``outputs`` (the same tensors: in place) through the launcher;
    return the engine handle. Collective as :func:`perseus.runtime.collectives.grouped_allreduce_async`.

    ``dtypes`` are the engine's codes; ``finish`` makes synchronize's value (a 1-tuple: that value).

    Raises:
        ValueError: a request of the same name is in flight on this rank; the process set is unknown.
    """
    device = inputs[0].device
    launcher = _launcher_for(device)
    code = _CUDA if device.type == "cuda" else _CPU
    streams = launcher.streams[code]
    ready = streams.ready(inputs[0])
    entries = []
    for i, o in zip(inputs, outputs):
        out = o.detach()
        entries.append(_Entry(out if i is o else i.detach(), out, ready))  # in place: one tensor, no copy
    if streams.ordered:  # synchronize's value comes once the caller's stream waits for the units
        value = finish[0]

        def finish(_results):
            caller_wait(streams, entries)
            return value
    if single:  # the per-gradient path: one native call, no request tuples
        engine, ps_id = _c._target(process_set)
        if prescale_factor != 1.0 or postscale_factor != 1.0:
            prescale_factor, postscale_factor = _c._factors(prescale_factor, postscale_factor, "allreduce")
        entry = entries[0]
        full = _c._name("allreduce", name, ps_id)
        ptr = entry.output.data_ptr()
        handle = engine.submit_one(ps_id, _ALLREDUCE, full, int(dtypes[0]), entry.output.shape, ptr, ptr, int(op),
                                   -1, float(prescale_factor), float(postscale_factor), 0, None, finish, entries,
                                   None, code)
        launcher.register_one(ps_id, full, entry, process_set, handle)
        return handle

    def register(ps_id, names, handle):
        launcher.register(ps_id, names, entries, process_set, handle)

    return _c.device_allreduce_async([tuple(o.shape) for o in outputs], dtypes, [o.data_ptr() for o in outputs],
                                     name, op, prescale_factor, postscale_factor, process_set, finish, entries,
                                     register, single, code)


def stats(process_set=global_process_set) -> dict:
    """What the device launcher has moved for ``process_set`` since ``init()`` on this rank: ``launches`` (units:
    one collective call each, e.g. one NCCL all-reduce), ``tensors`` (the tensor pieces they carried) and
    ``bytes``, cumulative (the difference over N training steps, divided by N, gives launches per step);
    ``bucket_bytes``, the device buckets' budget in force; once the set's groups are built and measured,
    ``launch_cost_s`` and ``bandwidth_bytes_per_s`` (what the budget was chosen from). Local (no
    communication); zero counts before the first device all-reduce.

    Raises:
        ValueError: perseus is not initialized, the set is not registered, or this rank is not a member.
    """
    ps_id = _runtime.process_set_info(process_set)[0]
    launcher = _launcher
    counts = launcher.counts.get(ps_id) if launcher is not None else None
    launches, tensors, nbytes = counts if counts is not None else (0, 0, 0)
    out = {"launches": launches, "tensors": tensors, "bytes": nbytes,
           "bucket_bytes": _runtime.engine.params(ps_id)[6]}
    if launcher is not None and ps_id in launcher.calibration:
        out.update(launcher.calibration[ps_id])
    return out


def launched(ps_id: int = 0) -> bool:
    """Whether the launcher has moved a unit of process set ``ps_id`` in this job (local)."""
    launcher = _launcher
    return launcher is not None and bool(launcher.counts.get(ps_id, (0,))[0])


def use_path(code: int) -> None:
    """From now on device all-reduces and collectives go through the launcher (``code`` 0) or host memory (1:
    staged; CPU tensors under ``PERSEUS_DEVICE_BACKEND=gloo``: the engine's own channels). The autotuner's
    choice (perseus.autotune.space.PATH), applied by the optimizer at a step boundary every rank agreed on: every
    rank must switch at the same point."""
    global _nccl, _gloo
    on = int(code) == 0
    if backend() == "gloo":
        _gloo = on
    else:
        _nccl = on and torch.distributed.is_available() and torch.distributed.is_nccl_available()
    for changed in _path_listeners:
        changed()


#: called after use_path() (perseus.torch._allreduce_ops reads its routing flags again)
_path_listeners: list = []


def forget(handle) -> None:
    """After ``synchronize(handle)`` raised: the launcher lets go of that request's tensors."""
    launcher = _launcher
    if launcher is not None:
        launcher.forget(handle)


_tensors._failed_wait_hooks.append(forget)


_launcher_lock = threading.Lock()
_launcher: Optional[_Launcher] = None


def _launcher_for(device) -> _Launcher:
    global _launcher
    launcher = _launcher
    if launcher is not None and launcher.owner is _runtime.active_engine:  # (the per-gradient path)
        if launcher._device is None and device.type == "cuda":
            launcher._device = device
        return launcher
    engine = _runtime.engine
    if launcher is None or launcher.engine is not engine._native:
        with _launcher_lock:
            launcher = _launcher
            if launcher is None or launcher.engine is not engine._native:
                launcher = _launcher = _Launcher(engine._native)
                launcher.owner = engine
    if launcher._device is None and device.type == "cuda":
        launcher._device = device
    return launcher


def _forget() -> None:
    """At shutdown (the engine has stopped): close this job's launcher; read the settings again next time."""
    global _launcher, _gloo, _nccl
    launcher, _launcher, _gloo, _nccl = _launcher, None, None, None
    if launcher is not None:
        launcher.close()


_runtime.register_job_state(_forget)
