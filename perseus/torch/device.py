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
"""

from __future__ import annotations

import datetime
import logging
import queue
import socket
import threading
import time
from contextlib import nullcontext
from typing import Optional

import numpy as np
import torch

from perseus.runtime import collectives as _c
from perseus.runtime.state import runtime
from perseus.base.knobs import external, set_external_default
from perseus.runtime.process_sets import global_process_set
from perseus.torch import _tensors, device_ops as _ops

__all__ = ["backend", "routes_cpu", "takes", "allreduce_async", "stats", "Streams", "CudaStreams", "HostStreams"]

_runtime = runtime()

# What NCCL (and gloo) reduce: the engine's dtype codes.
_FLOATS = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
_INTS = {torch.uint8, torch.int8, torch.int32, torch.int64}
_SUM, _AVERAGE, _MIN, _MAX, _PRODUCT = 1, 0, 3, 4, 5  # perseus ReduceOp codes (perseus.base.reduce_ops)
CALIBRATION_LAUNCHES = 8  # a device bucket's transfer takes this many launch costs (see _Launcher._calibrate)
_log = logging.getLogger("perseus")


# -- the stream shim ---------------------------------------------------------------------------------------
class Streams:
    """Ordering between the callers' streams and the launcher's (one object per backend).

    ``ordered``: completion is stream-ordered. The launcher queues a unit's work (:meth:`run`), takes a done
    token (:meth:`done`) and completes the unit's requests at once; ``synchronize`` makes the caller's stream
    wait for the token (:meth:`caller_wait`) instead of the host waiting, and the finalizer only keeps the
    tensors referenced until the token completes (:meth:`wait_done`). Otherwise (host memory) the finalizer
    waits for the work, finishes it and then completes the requests.
    """

    ordered = False

    def ready(self, tensor: torch.Tensor):
        """On the caller's thread at submission: an event marking that ``tensor``'s producers are queued."""
        return None

    def launch(self, key, device):
        """A context in which the launcher queues a unit's work (its stream for group ``key``)."""
        return nullcontext()

    def wait(self, event) -> None:
        """Inside :meth:`launch`: later work waits for ``event`` (from :meth:`ready`)."""

    def run(self, work, finish) -> None:
        """Inside :meth:`launch` (``ordered`` only): queue the wait for the backend's ``work``, then
        ``finish()`` (scaling, unpacking), on the launcher's stream."""
        raise NotImplementedError

    def done(self):
        """Inside :meth:`launch`: a token for the end of the unit's work (an event), for :meth:`wait_done`."""
        return None

    def caller_wait(self, done) -> None:
        """On the caller's thread at ``synchronize`` (``ordered`` only): work the caller queues from now on comes
        after the work behind ``done``."""

    def wait_done(self, done) -> None:
        """On the finalizer thread: return once the work behind ``done`` has finished (GIL released)."""


class HostStreams(Streams):
    """CPU tensors (the gloo backend): work is synchronous, nothing to order."""


class CudaStreams(Streams):
    """CUDA tensors: a stream per process group, events between it and the callers' streams; stream-ordered
    completion (``synchronize`` makes the caller's current stream wait for the unit's done event).

    The finalizer waits for a unit's done event (to let its tensors go) in CUDA with the GIL released: sleeping
    until the device signals (blocking-sync events, the default: nothing but the release of memory waits for
    it, and units may stay queued for long while the host runs ahead), or spinning when ``blocking`` is False.
    """

    ordered = True
    blocking = True

    def __init__(self):
        self._streams: dict = {}

    def ready(self, tensor):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tensor.device))
        return event

    def launch(self, key, device):
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = torch.cuda.Stream(device=device)
        return torch.cuda.stream(stream)

    def wait(self, event):
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def run(self, work, finish):
        work.wait()  # this stream waits for the collective (no host wait); finish's kernels queue behind it
        finish()

    def done(self):
        # A new event per unit: a caller may wait on it at any later time, so it is never recorded again.
        event = torch.cuda.Event(blocking=self.blocking)
        event.record()
        return event

    def caller_wait(self, done):
        torch.cuda.current_stream().wait_event(done)

    def wait_done(self, done):
        done.synchronize()


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


# -- the launcher ------------------------------------------------------------------------------------------
# The launcher's kinds of memory (the request signature's device code, which every rank must agree on).
_CUDA, _CPU = 0, 1
_ALLREDUCE = 0  # the unit's op type (perseus.engine.messages.OpType); the others run in device_ops


class _Launcher:
    """One per engine: the launcher thread, the finalizer thread, the groups and the in-flight tensors."""

    def __init__(self, engine):
        self.engine = engine
        self.owner = None  # the runtime's engine object whose native core ``engine`` is
        self.streams: dict = {_CUDA: CudaStreams() if torch.cuda.is_available() else HostStreams(),
                              _CPU: HostStreams()}
        self._lock = threading.Condition()
        self._entries: dict = {}  # (ps_id, name) -> _Entry, from submission until its data has moved
        self._waiting = 0  # launcher waits for a registration (under _lock): register() notifies only then
        self._groups: dict = {}   # (ps_id, kind) -> [process group per channel]
        self._sets: dict = {0: global_process_set}  # ps_id -> its ProcessSet (for the groups' rendezvous)
        self._free: dict = {}  # (ps_id, kind, channel, dtype) -> fusion buffers not in use
        self._done: queue.Queue = queue.Queue()
        self.counts: dict = {}  # ps_id -> [launches, tensors, bytes] (launcher thread; read by stats())
        self.calibration: dict = {}  # ps_id -> what _calibrate measured and chose
        self._device = None
        self._failed: Optional[str] = None
        self._thread = threading.Thread(target=self._run, name="perseus-device-launcher", daemon=True)
        self._finalizer = threading.Thread(target=self._finalize, name="perseus-device-finalizer", daemon=True)
        self._thread.start()
        self._finalizer.start()

    # caller's thread
    def register(self, ps_id, names, entries, process_set, handle) -> None:
        """The engine took these requests (engine handle ``handle``): the launcher may look them up (it waits
        for this). An entry left under the same name belonged to a request that failed before reaching the
        launcher: replaced."""
        with self._lock:
            self._sets.setdefault(ps_id, process_set)
            for n, e in zip(names, entries):
                e.handle = handle
                self._entries[(ps_id, n)] = e
            if self._waiting:
                self._lock.notify_all()

    def register_one(self, ps_id, name, entry, process_set, handle) -> None:
        """:meth:`register` of one request (the per-gradient path)."""
        entry.handle = handle
        with self._lock:
            if ps_id not in self._sets:
                self._sets[ps_id] = process_set
            self._entries[(ps_id, name)] = entry
            if self._waiting:
                self._lock.notify_all()

    def forget(self, handle) -> None:
        """The requests of ``handle`` failed (synchronize raised): drop what the launcher still holds of them
        (a request the engine rejected never reaches the launcher)."""
        with self._lock:
            for key in [k for k, e in self._entries.items() if e.handle == handle]:
                del self._entries[key]

    def _lookup(self, ps_id, pieces):
        """The entries of a unit's pieces (None for a joined rank's stand-ins), once registered."""
        keys = [None if phantom else (ps_id, name) for name, _, _, phantom in pieces]
        entries = self._entries
        with self._lock:
            if not all(k is None or k in entries for k in keys):
                # (the engine took a request before its submitter registered it: a moment's wait)
                self._waiting += 1
                try:
                    seen = self._lock.wait_for(lambda: all(k is None or k in entries for k in keys), 30.0)
                finally:
                    self._waiting -= 1
                if not seen:
                    missing = [k[1] for k in keys if k is not None and k not in entries]
                    raise RuntimeError(f"internal error: the launcher never saw the submission of {missing}")
            return [None if k is None else entries[k] for k in keys]

    # launcher thread
    def _run(self) -> None:
        while True:
            unit = self.engine.next_device_unit(1.0)
            if unit is None:
                continue
            if unit is False:
                break
            ticket, ps_id, index, pieces, kind = unit[0], unit[1], unit[2], unit[8], unit[9]
            try:
                if self._failed is not None:
                    raise RuntimeError(self._failed)
                token, host, real = self._launch(ps_id, index, unit[3], unit[4], unit[5], unit[6], unit[7], pieces,
                                                 kind)
            except Exception as exc:  # noqa: BLE001 - every failure fails the unit on every rank
                self._failed = self._failed or f"{type(exc).__name__}: {exc}"
                self._abort_groups()
                self._release(ps_id, pieces)
                self.engine.device_unit_done(ticket, self._failed)
                continue
            if host is None:
                # Stream-ordered: the work is queued; the requests complete now (synchronize makes the caller's
                # stream wait for the token) and the finalizer keeps their tensors until the token completes.
                for e in real:
                    e.done.append(token)
                self._release(ps_id, pieces)
                self.engine.device_unit_done(ticket, None)
                self._done.put((token, None, None, ps_id, pieces, kind, real))
            else:
                self._done.put((token, host, ticket, ps_id, pieces, kind, None))
        self._done.put(None)

    def _launch(self, ps_id, index, op_type, dtype_code, reduce_op, prescale, postscale, pieces, kind):
        if kind == _CUDA:
            if self._device is None:  # a joined rank that never submitted a GPU tensor
                self._device = torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.current_device() != self._device.index:
                torch.cuda.set_device(self._device)  # this thread's current device
        groups = self._groups.get((ps_id, kind))
        if groups is None:
            groups = self._groups[(ps_id, kind)] = self._make_groups(ps_id, kind)
            self._calibrate(ps_id, kind, groups[0])
        channel = index % len(groups)
        streams = self.streams[kind]
        entries = self._lookup(ps_id, pieces)
        real = [e for e in entries if e is not None]
        dtype = _TORCH_DTYPES[dtype_code]
        total = sum(p[2] for p in pieces)
        counts = self.counts.get(ps_id)
        if counts is None:
            counts = self.counts[ps_id] = [0, 0, 0]
        counts[0] += 1
        counts[1] += len(pieces)
        counts[2] += total * dtype.itemsize
        if op_type != _ALLREDUCE:  # one request: broadcast, allgather, alltoall or reducescatter
            if not real:
                raise RuntimeError(f"internal error: a joined rank's stand-in for {pieces[0][0]} (only all-reduces "
                                   "run while a rank has joined)")
            group = groups[channel]
            with streams.launch((ps_id, channel), self._device):
                streams.wait(real[0].ready)
                work, finish = _ops.launch(group, op_type, real[0], reduce_op, prescale, postscale, group.size(),
                                          group.rank(), _OPTIONS)
                return self._queued(streams, work, finish, real)
        with streams.launch((ps_id, channel), self._device):
            for event in {id(e.ready): e.ready for e in real}.values():
                streams.wait(event)
            lone = len(pieces) == 1 and entries[0] is not None
            pooled = None
            if lone:
                _, offset, count, _ = pieces[0]
                e = entries[0]
                buf = e.output.view(-1)[offset:offset + count]
                if e.input is not e.output:
                    buf.copy_(e.input.reshape(-1)[offset:offset + count])
            else:
                # Packed with one call (one kernel on a GPU), unpacked with one: a bucket has dozens of tensors.
                pooled = (ps_id, kind, channel, dtype)
                whole = self._take_buffer(pooled, total, self._device if kind == _CUDA else "cpu")
                buf = whole[:total]
                torch.cat([buf.new_zeros(count) if e is None else e.input.reshape(-1)[offset:offset + count]
                           for (_, offset, count, _), e in zip(pieces, entries)], out=buf)
            if prescale != 1.0:
                buf.mul_(prescale)
            work = self._collective(groups[channel], buf, reduce_op)

            def finish():
                """After the all-reduce: scale and unpack, then give the fusion buffer back."""
                if postscale != 1.0:
                    buf.mul_(postscale)
                if not lone:
                    parts = buf.split([p[2] for p in pieces])
                    outs = [e.output.view(-1)[offset:offset + count]
                            for (_, offset, count, _), e in zip(pieces, entries) if e is not None]
                    _copy_all(outs, [part for part, e in zip(parts, entries) if e is not None])
                    self._free.setdefault(pooled, []).append(whole)

            return self._queued(streams, work, finish, real)

    @staticmethod
    def _queued(streams, work, finish, real):
        """``(done token, host part, entries)`` of a unit whose collective ``work`` has started (inside the
        stream context): stream-ordered, the wait and ``finish`` are queued on the stream (a later unit reusing
        the fusion buffer on this stream comes after the unpack) and the host part is None; in host memory, the
        collective runs on the backend's own threads while this thread launches the next unit, and the
        finalizer waits for it and calls ``finish`` (the host part)."""
        if streams.ordered:
            streams.run(work, finish)
            return streams.done(), None, real
        return streams.done(), (work, finish), real

    def _collective(self, group, buf, reduce_op):
        """Start one all-reduce of ``buf`` on ``group`` and return its work (every launch, and the calibration,
        goes through here)."""
        return group.allreduce([buf], _OPTIONS[reduce_op])

    def _calibrate(self, ps_id, kind, group) -> None:
        """Measure what a launch costs on the set's new groups and choose the device buckets' budget from it, the
        same on every rank (collective: every member does this at the set's first unit of ``kind``).

        The cost of a launch is the median time of an all-reduce of 256 bytes; the bandwidth comes from one of
        8 MiB; each is the slowest rank's (an all-reduce MAX over the group). The budget is the size whose
        transfer takes CALIBRATION_LAUNCHES launch costs (so a launch's fixed cost is at most about 1/8 of it),
        at least DDP's 25 MiB and at most 256 MiB: large where launches are expensive, DDP-like where they are
        cheap. It takes effect at a negotiated point (a TUNE request whose other values stay as they are). An
        explicit PERSEUS_DEVICE_BUCKET_BYTES is kept. Failures leave the default in force."""
        settings = _runtime.settings
        if settings.is_explicit("device_bucket_bytes") or settings.device_bucket_bytes <= 0:
            return
        device = self._device if kind == _CUDA else "cpu"
        sync = torch.cuda.synchronize if kind == _CUDA else (lambda *a: None)

        def timed(numel, repeats):
            buf = torch.zeros(numel, dtype=torch.float32, device=device)
            self._collective(group, buf, _SUM).wait()  # (first use: connections, buffers)
            sync(device)
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                self._collective(group, buf, _SUM).wait()
                sync(device)
                times.append(time.perf_counter() - start)
            return sorted(times)[len(times) // 2]

        try:
            small = timed(64, 9)
            large = timed(2 << 20, 3)
            agreed = torch.tensor([small, max(large - small, 1e-9)], dtype=torch.float64, device=device)
            self._collective(group, agreed, _MAX).wait()
            sync(device)
            cost, seconds_per_8mib = (float(v) for v in agreed.cpu())
            bandwidth = (8 << 20) / seconds_per_8mib
            budget = int(min(max(CALIBRATION_LAUNCHES * cost * bandwidth, 25 << 20), 256 << 20))
            self.calibration[ps_id] = {"launch_cost_s": cost, "bandwidth_bytes_per_s": bandwidth,
                                       "bucket_bytes": budget}
            engine = _runtime.engine
            _c.synchronize(engine.tune(ps_id, f"perseus.device.budget.{ps_id}.{kind}", -1, -1, -1, -1, -1, budget))
        except Exception as exc:  # noqa: BLE001 - the default budget stays; the job goes on
            _log.warning("perseus: measuring the device launch cost failed (%s: %s); device buckets keep their "
                         "default budget", type(exc).__name__, exc)

    def _take_buffer(self, key, numel, device):
        """A fusion buffer for ``key`` (ps_id, kind, channel, dtype) of at least ``numel`` elements (a power of
        two), from those given back (by finish(), on the launcher or the finalizer thread) or new. A step reuses
        the buffers of the one before."""
        free = self._free.setdefault(key, [])
        for i in range(len(free) - 1, -1, -1):
            if free[i].numel() >= numel:
                return free.pop(i)
        if free:
            free.pop(0)  # a smaller one: let it go
        size = max(numel, 1 << 16)
        return torch.empty(1 << (size - 1).bit_length(), dtype=key[3], device=device)

    def _make_groups(self, ps_id, kind):
        """The set's process groups for ``kind`` (NCCL for GPU memory, Gloo for CPU memory), built collectively:
        at the set's first unit of that kind, on every member."""
        from torch._C._distributed_c10d import PrefixStore, TCPStore

        settings = _runtime.settings
        process_set = self._sets.get(ps_id)
        if process_set is None:
            raise RuntimeError(f"process set {ps_id}: this rank joined before submitting any GPU tensor to it, so "
                               "it cannot build its NCCL groups; submit a GPU all-reduce on every rank first")
        members = _runtime.process_set_ranks(ps_id)
        rank, size = members.index(_runtime.rank()), len(members)
        timeout = datetime.timedelta(seconds=max(settings.stall_shutdown_time_s, settings.stall_check_time_s) + 60)
        info = np.zeros(256, np.uint8)
        if rank == 0:
            host = "127.0.0.1" if _runtime.cross_size() == 1 else socket.gethostbyname(socket.gethostname())
            store = TCPStore(host, 0, size, True, timeout, wait_for_workers=False)
            text = f"{host}:{store.port}".encode()
            info[:len(text)] = np.frombuffer(text, np.uint8)
        _c.synchronize(_c.broadcast_async(info, info, members[0], name=f"perseus.device.store.{ps_id}.{kind}",
                                          process_set=process_set))
        if rank != 0:
            host, port = bytes(info).rstrip(b"\0").decode().rsplit(":", 1)
            store = TCPStore(host, int(port), size, False, timeout)
        groups = []
        for channel in range(max(1, int(settings.num_nccl_streams))):
            prefixed = PrefixStore(f"perseus/{ps_id}/{kind}/{channel}", store)
            if kind == _CUDA:
                from torch._C._distributed_c10d import ProcessGroupNCCL

                if external("NCCL_LAUNCH_ORDER_IMPLICIT") is None and torch.cuda.nccl.version() >= (2, 26, 0):
                    # Groups run concurrently: NCCL orders their kernels as this one thread launches them.
                    set_external_default("NCCL_LAUNCH_ORDER_IMPLICIT", "1")
                group = ProcessGroupNCCL(prefixed, rank, size, ProcessGroupNCCL.Options())
            else:
                from torch._C._distributed_c10d import ProcessGroupGloo

                group = ProcessGroupGloo(prefixed, rank, size, timeout)
            group._set_default_timeout(timeout)
            groups.append(group)
        return groups

    def close(self) -> None:
        """After the engine has stopped: let the threads finish and release the groups' communicators
        (abort: never waits for a peer, which may be gone)."""
        self._thread.join(5.0)
        self._finalizer.join(5.0)
        self._abort_groups()
        self._groups.clear()
        self._free.clear()

    def _abort_groups(self):
        for groups in self._groups.values():
            for g in groups:
                abort = getattr(g, "abort", None)
                if abort is not None:
                    try:
                        abort()
                    except Exception:  # noqa: BLE001 - already failing
                        pass

    def _release(self, ps_id, pieces) -> None:
        """Count the pieces' elements as moved; forget requests whose every element has (before the engine
        completes them, so that the name may be submitted again at once)."""
        with self._lock:
            for name, _, count, phantom in pieces:
                if phantom:
                    continue
                e = self._entries.get((ps_id, name))
                if e is not None:
                    e.moved += count
                    if e.moved >= e.numel:
                        del self._entries[(ps_id, name)]

    # finalizer thread
    def _finalize(self) -> None:
        while True:
            item = self._done.get()
            if item is None:
                return
            token, host, ticket, ps_id, pieces, kind, kept = item
            error = None
            try:
                if host is not None:  # a host-memory collective still running on the backend's threads
                    host[0].wait()
                    host[1]()
                self.streams[kind].wait_done(token)
            except Exception as exc:  # noqa: BLE001 - the unit failed on the device
                error = f"{type(exc).__name__}: {exc}"
            if ticket is None:  # completed when queued: only its tensors (kept) waited for the device
                if error is not None:
                    # Its requests have completed; every later unit fails on every rank with this.
                    self._failed = self._failed or f"a device collective failed after it was queued: {error}"
                    _log.error("perseus: %s", self._failed)
                del kept
                continue
            self._release(ps_id, pieces)
            self.engine.device_unit_done(ticket, error)


_TORCH_DTYPES = {0: torch.uint8, 1: torch.int8, 2: torch.int16, 3: torch.int32, 4: torch.int64, 5: torch.float16,
                 6: torch.bfloat16, 7: torch.float32, 8: torch.float64, 9: torch.bool}
def _options(reduce_op):
    options = torch.distributed.AllreduceOptions()
    options.reduceOp = reduce_op
    return options


_OPTIONS = {}  # perseus ReduceOp code -> the backends' all-reduce options (made once)
if torch.distributed.is_available():
    _R = torch.distributed.ReduceOp
    _OPTIONS = {_SUM: _options(_R.SUM), _AVERAGE: _options(_R.SUM), _MIN: _options(_R.MIN),
                _MAX: _options(_R.MAX), _PRODUCT: _options(_R.PRODUCT)}

def _copy_all(outs, ins) -> None:
    """outs[i].copy_(ins[i]) for every i, in one call where torch has it."""
    if not outs:  # (a joined rank's unit: stand-ins only)
        return
    if _foreach_copy is not None:
        _foreach_copy(outs, ins)
    else:
        for o, i in zip(outs, ins):
            o.copy_(i)


_foreach_copy = getattr(torch, "_foreach_copy_", None)


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
