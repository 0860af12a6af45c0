"""The device transport for torch: all-reduces of GPU tensors with NCCL, planned by the engine.

The engine negotiates and fuses device requests like any other (every rank gets the same units in the same
order) but does not move their data: it hands each unit to this module's launcher thread (one per process),
which moves it with a torch.distributed backend and gives the unit back. Only all-reduce takes this path;
every other collective, and what NCCL cannot reduce (Adasum, int16, bool, integer averages), is staged through
host memory (:mod:`perseus.torch.staging`).

- Process groups: ``PERSEUS_NUM_NCCL_STREAMS`` (horovodrun's ``--num-nccl-streams``) per process set, each with
  its own NCCL communicator and stream; unit k goes to group k modulo their number. They are built over
  perseus's own ranks at the set's first device unit: its first rank starts a ``TCPStore`` on a free port and
  broadcasts the address with a perseus broadcast; each group gets a prefix of that store. The user's
  default process group is never touched.
- The launcher thread takes units in order. For each: its stream waits for the events recorded on the
  callers' streams at submission, packs the pieces into the group's fusion buffer (or reduces a lone tensor
  in place), prescales, all-reduces with SUM (or MIN/MAX/PRODUCT), postscales, unpacks, and records a done
  event. A finalizer thread waits for that event (GIL released) and only then completes the requests, so
  ``synchronize`` returns finished tensors and every tensor stays referenced until its data has moved.
- Failure: an error in the launcher fails the unit's requests on every rank (the engine's abort, naming the
  tensors); NCCL groups are aborted. Group timeouts exceed perseus's stall shutdown time.
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

from perseus.common import collectives as _c
from perseus.common.state import runtime
from perseus.common.knobs import external, set_external_default
from perseus.common.process_sets import global_process_set

__all__ = ["backend", "routes_cpu", "takes", "allreduce_async", "stats", "Streams", "CudaStreams", "HostStreams"]

_runtime = runtime()

# What NCCL (and gloo) reduce: the engine's dtype codes.
_FLOATS = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
_INTS = {torch.uint8, torch.int8, torch.int32, torch.int64}
_SUM, _AVERAGE, _MIN, _MAX, _PRODUCT = 1, 0, 3, 4, 5  # perseus ReduceOp codes (perseus.common.reduce_ops)
CALIBRATION_LAUNCHES = 8  # a device bucket's transfer takes this many launch costs (see _Launcher._calibrate)
_log = logging.getLogger("perseus")


# -- the stream shim ---------------------------------------------------------------------------------------
class Streams:
    """Ordering between the callers' streams and the launcher's (one object per backend)."""

    def ready(self, tensor: torch.Tensor):
        """On the caller's thread at submission: an event marking that ``tensor``'s producers are queued."""
        return None

    def launch(self, key, device):
        """A context in which the launcher queues a unit's work (its stream for group ``key``)."""
        return nullcontext()

    def wait(self, event) -> None:
        """Inside :meth:`launch`: later work waits for ``event`` (from :meth:`ready`)."""

    def done(self):
        """Inside :meth:`launch`: a token for the end of the unit's work (an event), for :meth:`wait_done`."""
        return None

    def wait_done(self, done) -> None:
        """On the finalizer thread: return once the work behind ``done`` has finished (GIL released)."""


class HostStreams(Streams):
    """CPU tensors (the gloo backend): work is synchronous, nothing to order."""


class CudaStreams(Streams):
    """CUDA tensors: a stream per process group, events between it and the callers' streams.

    The finalizer waits for a unit's done event in CUDA with the GIL released: spinning by default (the
    lowest latency; a core is busy only while a unit is in flight), or sleeping until the device signals
    when ``blocking`` is set (measured against each other in docs/gpu.md).
    """

    blocking = False

    def __init__(self):
        self._streams: dict = {}
        self._free: dict = {False: [], True: []}  # done events waited for, to record again (by blocking flag)

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

    def done(self):
        blocking = self.blocking
        free = self._free[blocking]
        event = free.pop() if free else torch.cuda.Event(blocking=blocking)
        event.record()
        return event, blocking

    def wait_done(self, done):
        event, blocking = done
        event.synchronize()
        self._free[blocking].append(event)  # recorded again later (list append/pop: atomic under the GIL)


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
    __slots__ = ("input", "output", "ready", "numel", "moved")

    def __init__(self, inp, out, ready):
        self.input, self.output, self.ready = inp, out, ready
        self.numel, self.moved = out.numel(), 0


def allreduce_async(inputs, outputs, dtypes, name, op, prescale_factor, postscale_factor, process_set, finish,
                    single: bool) -> int:
    """Start an allreduce of ``inputs`` into ``outputs`` (the same tensors: in place) through the launcher;
    return the engine handle. Collective as :func:`perseus.common.collectives.grouped_allreduce_async`.

    ``dtypes`` are the engine's codes; ``finish`` makes synchronize's value (a 1-tuple: that value).

    Raises:
        ValueError: a request of the same name is in flight on this rank; the process set is unknown.
    """
    device = inputs[0].device
    launcher = _launcher_for(device)
    code = _CUDA if device.type == "cuda" else _CPU
    ready = launcher.streams[code].ready(inputs[0])
    entries = []
    for i, o in zip(inputs, outputs):
        out = o.detach()
        entries.append(_Entry(out if i is o else i.detach(), out, ready))  # in place: one tensor, no copy

    def register(ps_id, names):
        launcher.register(ps_id, names, entries, process_set)
    return _c.device_allreduce_async([tuple(o.shape) for o in outputs], dtypes, [o.data_ptr() for o in outputs],
                                     name, op, prescale_factor, postscale_factor, process_set, finish, entries,
                                     register, single, code)


# -- the launcher ------------------------------------------------------------------------------------------
# The launcher's kinds of memory (the request signature's device code, which every rank must agree on).
_CUDA, _CPU = 0, 1


class _Launcher:
    """One per engine: the launcher thread, the finalizer thread, the groups and the in-flight tensors."""

    def __init__(self, engine):
        self.engine = engine
        self.streams: dict = {_CUDA: CudaStreams() if torch.cuda.is_available() else HostStreams(),
                              _CPU: HostStreams()}
        self._lock = threading.Condition()
        self._entries: dict = {}  # (ps_id, name) -> _Entry, from submission until its data has moved
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
    def register(self, ps_id, names, entries, process_set) -> None:
        """The engine took these requests: the launcher may look them up (it waits for this). An entry left
        under the same name belonged to a request that failed before reaching the launcher: replaced."""
        with self._lock:
            self._sets.setdefault(ps_id, process_set)
            for n, e in zip(names, entries):
                self._entries[(ps_id, n)] = e
            self._lock.notify_all()

    def _lookup(self, ps_id, pieces):
        """The entries of a unit's pieces (None for a joined rank's stand-ins), once registered."""
        keys = [None if phantom else (ps_id, name) for name, _, _, phantom in pieces]
        with self._lock:
            if not self._lock.wait_for(lambda: all(k is None or k in self._entries for k in keys), 30.0):
                missing = [k[1] for k in keys if k is not None and k not in self._entries]
                raise RuntimeError(f"internal error: the launcher never saw the submission of {missing}")
            return [None if k is None else self._entries[k] for k in keys]

    # launcher thread
    def _run(self) -> None:
        while True:
            unit = self.engine.next_device_unit(1.0)
            if unit is None:
                continue
            if unit is False:
                break
            ticket, ps_id, index = unit[0], unit[1], unit[2]
            try:
                if self._failed is not None:
                    raise RuntimeError(self._failed)
                done = self._launch(ps_id, index, unit[4], unit[5], unit[6], unit[7], unit[8], unit[9])
            except Exception as exc:  # noqa: BLE001 - every failure fails the unit on every rank
                self._failed = self._failed or f"{type(exc).__name__}: {exc}"
                self._abort_groups()
                self._release(ps_id, unit[8])
                self.engine.device_unit_done(ticket, self._failed)
                continue
            self._done.put((done, ticket, ps_id, unit[8], unit[9]))
        self._done.put(None)

    def _launch(self, ps_id, index, dtype_code, reduce_op, prescale, postscale, pieces, kind):
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

            if kind == _CUDA:
                # Stream-ordered: wait() makes this stream wait for NCCL, and what follows is queued behind it
                # (a later unit reusing the buffer on this stream comes after the unpack).
                work.wait()
                finish()
                return streams.done(), None
            # Host memory: the all-reduce runs on the backend's own threads while this thread launches the next
            # unit; the finalizer waits for it, then unpacks.
            return streams.done(), (work, finish)

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
            (event, host), ticket, ps_id, pieces, kind = item
            error = None
            try:
                if host is not None:  # a host-memory all-reduce still running on the backend's threads
                    host[0].wait()
                    host[1]()
                self.streams[kind].wait_done(event)
            except Exception as exc:  # noqa: BLE001 - the unit failed on the device
                error = f"{type(exc).__name__}: {exc}"
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


_launcher_lock = threading.Lock()
_launcher: Optional[_Launcher] = None


def _launcher_for(device) -> _Launcher:
    global _launcher
    engine = _runtime.engine
    launcher = _launcher
    if launcher is None or launcher.engine is not engine._native:
        with _launcher_lock:
            launcher = _launcher
            if launcher is None or launcher.engine is not engine._native:
                launcher = _launcher = _Launcher(engine._native)
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
