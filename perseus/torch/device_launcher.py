"""The device launcher (:mod:`perseus.torch.device`): one per engine, a launcher thread that moves the units
the engine hands it and a finalizer thread that waits for them.

- The launcher thread takes units in order (every rank gets the same units in the same order). For each: its
  stream waits for the events recorded on the callers' streams at submission, packs the pieces into the
  group's fusion buffer (or reduces a lone tensor in place), prescales, all-reduces, postscales, unpacks, and
  records a done event; a unit that is not an all-reduce runs in :mod:`perseus.torch.device_ops`.
- The finalizer keeps a stream-ordered unit's tensors referenced until its done event has completed; in host
  memory it waits for the collective, unpacks, and then completes the unit's requests.
- Failure: an error in the launcher fails the unit's requests on every rank (the engine's abort, naming the
  tensors) and aborts the groups; a device error found after a unit completed fails every later unit.

The process groups and the launch-cost measurement are in :mod:`perseus.torch.device_groups`, the stream shim in
:mod:`perseus.torch.device_streams`.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Optional

import torch

from perseus.runtime.process_sets import global_process_set
from perseus.torch import device_ops as _ops
from perseus.torch.device_groups import _CPU, _CUDA, _OPTIONS, LauncherGroups
from perseus.torch.device_streams import CudaStreams, HostStreams

_ALLREDUCE = 0  # the unit's op type (perseus.engine.messages.OpType); the others run in device_ops
_log = logging.getLogger("perseus")


class _Launcher(LauncherGroups):
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

    def close(self) -> None:
        """After the engine has stopped: let the threads finish and release the groups' communicators
        (abort: never waits for a peer, which may be gone)."""
        self._thread.join(5.0)
        self._finalizer.join(5.0)
        self._abort_groups()
        self._groups.clear()
        self._free.clear()

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
