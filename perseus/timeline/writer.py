"""Record engine activity as a Chrome-trace JSON file, written by a background thread.

Callers (the engine's hot path) only take a lock, read the clock and put a tuple on a queue; the writer thread
turns queued tuples into JSON and appends them. The file is ``[`` + events separated by ``,\\n`` + ``\\n]``:
each batch is written over the closing ``\\n]`` together with a new one, in a single ``pwrite``, so a reader or
a crash always finds valid JSON.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import queue
import threading
import time

from perseus.timeline.events import CYCLE_START, PROCESS_NAME, TIMELINE_TRUNCATED, WIRE_BYTES, negotiate_name

__all__ = ["Timeline"]

log = logging.getLogger("perseus")

_STOP = object()
_OP_NAMES = ("ALLREDUCE", "ALLGATHER", "BROADCAST", "ALLTOALL", "REDUCESCATTER", "BARRIER")
_TAIL = b"\n]"
_BATCH = 4096  # most queued items turned into one write
UNIT_NAME_SEPARATOR = "\x1f"  # between the tensor names of one device launch's record (native/device_channel.h)


def _quiet(method):
    """Wrap a recording method so that a bad argument is logged, never raised into the engine."""

    @functools.wraps(method)
    def wrapper(self, *args):
        try:
            method(self, *args)
        except Exception:  # noqa: BLE001 - the timeline must never break the job
            log.debug("timeline: %s failed", method.__name__, exc_info=True)

    return wrapper


def _encode(event: dict) -> bytes:
    return json.dumps(event, separators=(",", ":")).encode()


def _op_name(entry) -> str:
    op = getattr(getattr(entry, "signature", None), "op_type", None)
    return "UNKNOWN" if op is None else (getattr(op, "name", None) or str(op).upper())


class _Row:
    """What is open on one tensor's row: at most one of negotiation / op, and a sub-activity inside the op."""

    __slots__ = ("pid", "negotiating", "op", "activity")

    def __init__(self, pid: int):
        self.pid = pid
        self.negotiating = self.op = self.activity = False


class Timeline:
    """Write a Chrome-trace JSON timeline of tensor activity to ``path``.

    Every tensor name gets its own row (a trace "process", pid 1, 2, ... in order of first appearance); pid 0
    is the ``perseus`` row carrying ``CYCLE_START`` markers. Timestamps are microseconds since construction
    (monotonic clock). Recording methods are thread-safe, cheap and never raise; calls that would break the
    nesting of a row (an end without a begin, a sub-activity outside an op) are ignored. Once the file would
    exceed ``max_bytes`` a ``TIMELINE_TRUNCATED`` marker is written and nothing more is recorded.

    Raises:
        ValueError: ``path`` is a directory or cannot be opened for writing.
    """

    def __init__(self, path: str, mark_cycles: bool = False, max_bytes: int = 256 << 20):
        self.path = os.fspath(path)
        self._mark_cycles = bool(mark_cycles)
        self._max_bytes = int(max_bytes)
        if os.path.isdir(self.path):
            raise ValueError(f"cannot write the timeline to {self.path!r}: it is a directory")
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as exc:
            raise ValueError(f"cannot write the timeline to {self.path!r}: {exc.strerror or exc}") from None
        self._t0 = time.monotonic_ns()
        header = _encode({"name": "process_name", "ph": "M", "pid": 0,
                          "args": {"name": PROCESS_NAME, "start_time_since_epoch_in_micros": time.time_ns() // 1000}})
        self._reserve = len(b",\n" + self._marker(1e15))  # room always kept for the marker
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._rows: dict[str, _Row] = {}
        self._recording, self._closed = True, False
        self._full = False  # writer side: limit reached or write failed; discard what is still queued
        self._tail = 0  # file offset of the closing "\n]"
        try:
            self._write(b"[\n" + header)
        except OSError as exc:
            os.close(self._fd)
            raise ValueError(f"cannot write the timeline to {self.path!r}: {exc.strerror or exc}") from None
        self._thread = threading.Thread(target=self._run, name="perseus-timeline", daemon=True)
        self._thread.start()

    # -- recording (any thread) -----------------------------------------------------------------------
    @_quiet
    def negotiate_start(self, entry) -> None:
        """Begin ``NEGOTIATE_<OP>`` on the entry's row, first ending anything still open there."""
        self._negotiate_start(entry.name, _op_name(entry), None)

    @_quiet
    def negotiate_end(self, entry) -> None:
        """End ``NEGOTIATE_<OP>`` if it was begun, then begin ``<OP>`` on the entry's row."""
        self._negotiate_end(entry.name, _op_name(entry), None)

    @_quiet
    def activity_start_all(self, pieces, activity: str) -> None:
        """For each piece's entry with an open ``<OP>``, end its sub-activity (if any) and begin ``activity``."""
        self._activity([p.entry.name for p in pieces], activity, None)

    @_quiet
    def op_end(self, entry) -> None:
        """End the entry's sub-activity (if any) and its ``<OP>``."""
        self._op_end(entry.name, None)

    @_quiet
    def mark_cycle(self) -> None:
        """Record a ``CYCLE_START`` instant event on the pid-0 row if ``mark_cycles`` was set."""
        self._cycle(None)

    def _negotiate_start(self, name: str, op: str, ts) -> None:
        with self._lock:
            if not self._recording:
                return
            row, ts = self._row(name), self._now() if ts is None else ts
            self._end_all(row, ts)
            row.negotiating = True
            self._queue.put(("B", row.pid, negotiate_name(op), ts))

    def _negotiate_end(self, name: str, op: str, ts) -> None:
        with self._lock:
            if not self._recording:
                return
            row, ts = self._row(name), self._now() if ts is None else ts
            self._end_all(row, ts)
            row.op = True
            self._queue.put(("B", row.pid, op, ts))

    def _activity(self, names, activity: str, ts) -> None:
        with self._lock:
            if not self._recording:
                return
            ts = self._now() if ts is None else ts
            for name in names:
                row = self._rows.get(name)
                if row is None or not row.op:
                    continue  # not begun while recording (or a phantom entry): keep the row nested
                if row.activity:
                    self._queue.put(("E", row.pid, None, ts))
                row.activity = True
                self._queue.put(("B", row.pid, activity, ts))

    def _counter(self, name: str, values: dict) -> None:
        with self._lock:
            if self._recording:
                self._queue.put(("C", 0, name, self._now(), values))

    def _op_end(self, name: str, ts) -> None:
        with self._lock:
            row = self._rows.get(name)
            if self._recording and row is not None:
                self._end_all(row, self._now() if ts is None else ts)

    def _cycle(self, ts) -> None:
        if not self._mark_cycles:
            return
        with self._lock:
            if self._recording:
                self._queue.put(("i", 0, CYCLE_START, self._now() if ts is None else ts))

    # -- events recorded by the native engine ---------------------------------------------------------
    def ingest(self, events) -> None:
        """Apply events drained from the native engine: ``(kind, op, name, label, ts_ns)`` tuples, kind 0
        negotiation start, 1 op start, 2 sub-activity ``label``, 3 op end, 4 negotiation cycle."""
        for kind, op, name, label, ts_ns in events:
            ts = (ts_ns - self._t0) / 1000.0
            if kind == 0:
                self._negotiate_start(name, _OP_NAMES[op], ts)
            elif kind == 1:
                self._negotiate_end(name, _OP_NAMES[op], ts)
            elif kind == 2:  # (one record may name a unit's several tensors)
                self._activity(name.split(UNIT_NAME_SEPARATOR), label, ts)
            elif kind == 3:
                self._op_end(name, ts)
            elif kind == 4:
                self._cycle(ts)

    def attach(self, drain, period_s: float = 0.02, counters=None) -> None:
        """Poll ``drain()`` (a list of engine events) every ``period_s`` on a thread until :meth:`detach`.

        ``counters()``, when given, returns the engine's byte counters (a dict of cumulative byte counts);
        whenever they have changed since the last poll they are written as a ``WIRE_BYTES`` counter track
        (Chrome trace "C" events on the ``perseus`` row: the bytes sent and received since recording began)."""
        self.detach()
        stop = threading.Event()
        base = counters() if counters is not None else None
        last = [None]

        def pump():
            while True:
                stopping = stop.wait(period_s)
                try:
                    self.ingest(drain())
                    if counters is not None:
                        now = counters()
                        if now != last[0]:
                            last[0] = now
                            self._counter(WIRE_BYTES, {k: now[k] - base.get(k, 0) for k in now})
                except Exception:  # noqa: BLE001 - the timeline must never break the job
                    log.debug("timeline: ingesting engine events failed", exc_info=True)
                if stopping:
                    return

        thread = threading.Thread(target=pump, name="perseus-timeline-pump", daemon=True)
        self._pump = (stop, thread)
        thread.start()

    def detach(self) -> None:
        """Stop polling the engine (after one last drain)."""
        pump, self._pump = getattr(self, "_pump", None), None
        if pump is not None:
            pump[0].set()
            if threading.current_thread() is not pump[1]:
                pump[1].join()

    def close(self) -> None:
        """End every open activity, flush the file and join the writer thread; later calls do nothing."""
        self.detach()
        with self._lock:
            if not self._closed:
                self._closed = True
                if self._recording:
                    ts = self._now()
                    for row in self._rows.values():
                        self._end_all(row, ts)
                self._recording = False
                self._queue.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join()

    @property
    def truncated(self) -> bool:
        """Whether recording stopped because the file reached ``max_bytes`` (or could not be written)."""
        return self._full

    # -- helpers (caller holds the lock) --------------------------------------------------------------
    def _now(self) -> float:
        return (time.monotonic_ns() - self._t0) / 1000.0

    def _row(self, name: str) -> _Row:
        row = self._rows.get(name)
        if row is None:
            row = self._rows[name] = _Row(len(self._rows) + 1)
            self._queue.put(("M", row.pid, name))
        return row

    def _end_all(self, row: _Row, ts: float) -> None:
        for flag in ("activity", "op", "negotiating"):  # innermost first
            if getattr(row, flag):
                setattr(row, flag, False)
                self._queue.put(("E", row.pid, None, ts))

    # -- writer thread --------------------------------------------------------------------------------
    def _marker(self, ts: float) -> bytes:
        return _encode({"name": TIMELINE_TRUNCATED, "ph": "i", "s": "g", "pid": 0, "tid": 0, "ts": round(ts, 3),
                        "args": {"max_bytes": self._max_bytes,
                                 "reason": f"the timeline reached its size limit of {self._max_bytes} bytes"}})

    @staticmethod
    def _events(item) -> list[bytes]:
        if item[0] == "M":
            pid, name = item[1], item[2]
            return [_encode({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}),
                    _encode({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})]
        if item[0] == "C":
            _, pid, name, ts, values = item
            return [_encode({"name": name, "ph": "C", "pid": pid, "ts": round(ts, 3), "args": values})]
        ph, pid, name, ts = item
        event = {"ph": ph, "pid": pid, "tid": 0, "ts": round(ts, 3)} if name is None else \
            {"name": name, "ph": ph, "pid": pid, "tid": 0, "ts": round(ts, 3)}
        if ph == "i":
            event["s"] = "g"
        return [_encode(event)]

    def _run(self) -> None:
        try:
            stop = False
            while not stop:
                items = [self._queue.get()]  # sleeps while idle
                while len(items) < _BATCH:
                    try:
                        items.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                chunks, size = [], self._tail + len(_TAIL)
                for item in items:
                    if item is _STOP:
                        stop = True
                        break
                    if self._full:
                        continue
                    for event in self._events(item):
                        chunk = b",\n" + event
                        if size + len(chunk) + self._reserve > self._max_bytes:
                            chunks.append(b",\n" + self._marker(self._now()))
                            self._stop_recording()
                            break
                        chunks.append(chunk)
                        size += len(chunk)
                if chunks:
                    try:
                        self._write(b"".join(chunks))
                    except OSError as exc:
                        log.warning("perseus: timeline %r stopped: %s", self.path, exc)
                        self._stop_recording()
        finally:
            os.close(self._fd)

    def _stop_recording(self) -> None:
        self._full = True
        with self._lock:
            self._recording = False

    def _write(self, data: bytes) -> None:
        """Write ``data`` plus a new closing bracket over the current one, in one system call when possible."""
        buf, offset = memoryview(data + _TAIL), self._tail
        while buf:
            n = os.pwrite(self._fd, buf, offset)
            buf, offset = buf[n:], offset + n
        self._tail += len(data)
