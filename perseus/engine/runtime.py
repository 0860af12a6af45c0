"""One process set's negotiation state machine, driven by the engine thread.

Rounds follow three rules, identical on every rank, so no rank ever waits in a round that others will not
join for a reason other than missing work:

* a rank with new requests starts a round (after ``cycle_time_ms``, to gather requests that arrive together);
* after a round in which some rank had new requests or something became ready, every rank with pending work
  starts the next round at once (``continue`` mode);
* after a fruitless round (``sleep`` mode) ranks wait; the first rank with new requests sends a wake message to
  its peers, which then join the round even if they have nothing pending.

Waiting for peers inside a round is test-then-sleep; an idle set never touches the network.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Optional

import numpy as np

from perseus.common.exceptions import MismatchError, PerseusInternalError, StallError
from perseus.engine.channels import Channel
from perseus.engine.fusion import plan_units
from perseus.engine.messages import Entry, Handle, numpy_dtype
from perseus.engine.negotiation import Negotiator, RoundResult
from perseus.engine.stall import StallReport, format_stall, main_thread_location
from perseus.transport.mpi import MpiControl

__all__ = ["ProcessSetRuntime"]

log = logging.getLogger("perseus")

_IDLE, _BAND, _EXCHANGE, _JOINGATHER = range(4)
_CONTROL_POLL_S = 100e-6  # control messages (wake, probe, abort) are rare: look for them at most this often
_STALL_CHECK_S = 0.05


class ProcessSetRuntime:
    """Negotiation, fusion and channels for one process set on this rank."""

    def __init__(self, engine, ps_id: int, comm, world_ranks: list[int]):
        self.engine = engine
        self.id = ps_id
        self.settings = engine.settings
        self.world_ranks = world_ranks
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.control = MpiControl(comm)
        n_channels = 1 if self.settings.mpi_threads_disable else max(1, int(self.settings.num_channels))
        self.channels = [Channel(comm.Dup(), f"perseus-ps{ps_id}-ch{i}", self._entry_done, self._unit_failed,
                                 lambda: engine.timeline, self.settings.allreduce_algorithm) for i in range(n_channels)]
        self.negotiator = Negotiator(self.rank, self.size)
        # Shared with user threads. Appends to a deque and single-attribute writes are atomic, so the
        # submitting thread never waits for the engine thread (a lock convoy there cost milliseconds).
        self.incoming: collections.deque = collections.deque()  # submitted, not yet seen by the engine
        self.first_dirty = 0.0                   # when the oldest unseen submission arrived; 0 if none
        self.join_handle: Optional[Handle] = None
        self._names_lock = threading.Lock()
        self.inflight: dict[str, Entry] = {}     # submitted, not yet completed (duplicate-name check)
        # Engine-thread state:
        self.pending: dict[str, Entry] = {}      # seen by the engine, not yet negotiated
        self.state = _IDLE
        self.round = 0
        self.continue_mode = False
        self.woken_round = -1
        self.unit_counter = 0
        self._req = None
        self._words = None
        self._result: Optional[RoundResult] = None
        self._round_dirty = False
        self._join_round = -1
        self._join_buf = None
        self.dead: Optional[str] = None
        self._probe: Optional[StallReport] = None
        self._probe_counter = 0
        self._last_warn = 0.0
        self._last_poll = 0.0
        self._last_stall_check = 0.0

    # -- user threads ----------------------------------------------------------------------------------
    def submit(self, entries: list[Entry]) -> None:
        """Queue entries atomically (a group appears in one round). Raises ValueError on a duplicate name."""
        if self.dead is not None:
            raise PerseusInternalError(self.dead)
        with self._names_lock:
            for e in entries:
                if e.name in self.inflight:
                    raise ValueError(
                        f"perseus: a request named {e.name!r} is already in flight on this rank; wait for it "
                        f"(synchronize) before submitting the name again, or give the new request another name.")
            if len(entries) > 1 and len({e.name for e in entries}) != len(entries):
                raise ValueError("perseus: a grouped request names the same tensor twice")
            for e in entries:
                self.inflight[e.name] = e
        self.incoming.append(entries)
        if not self.first_dirty:
            self.first_dirty = time.monotonic()

    def submit_join(self, handle: Handle) -> None:
        if self.join_handle is not None:
            raise ValueError("perseus.join(): this rank has already joined; wait for the join to complete")
        self.join_handle = handle
        if not self.first_dirty:
            self.first_dirty = time.monotonic()

    # -- engine thread ---------------------------------------------------------------------------------
    def step(self, now: float) -> tuple[bool, bool, float]:
        """Advance the state machine once. Returns ``(progressed, waiting_on_peers, next_deadline)``."""
        if now - self._last_poll >= _CONTROL_POLL_S:
            self._last_poll = now
            self._poll_control(now)
        if self.dead is not None:
            return False, False, float("inf")
        if self.state == _IDLE:
            return self._maybe_start(now)
        if self.state == _BAND:
            if not self._req.Test():
                self._check_stall(now)
                return False, True, float("inf")
            self._finish_band()
            return True, self.state != _IDLE, now
        if self.state == _EXCHANGE:
            payloads = self._req.test()
            if payloads is None:
                self._check_stall(now)
                return False, True, float("inf")
            self.negotiator.apply_exchange(self._result, payloads, self.world_ranks, self.round)
            self._finish_round()
            return True, False, now
        if self.state == _JOINGATHER:
            if not self._req.Test():
                return False, True, float("inf")
            self._finish_join()
            return True, False, now
        raise AssertionError(self.state)

    def has_work(self) -> bool:
        return bool(self.pending) or bool(self.incoming) or self.join_handle is not None

    def _maybe_start(self, now: float) -> tuple[bool, bool, float]:
        first_dirty = self.first_dirty
        dirty, has_work = bool(first_dirty), self.has_work()
        woken = self.woken_round >= self.round
        if dirty and not woken:
            start_at = first_dirty + self.settings.cycle_time_ms * 1e-3
            if now < start_at:
                return False, False, start_at
            if not self.continue_mode:
                self.control.broadcast_message(("wake", self.round))
        elif not (woken or (self.continue_mode and has_work)):
            deadline = float("inf")
            if has_work:
                self._check_stall(now)
                deadline = now + 1e-3 if self._probe is not None else float("inf")
            return False, False, deadline
        self._start_round()
        return True, True, now

    def _start_round(self) -> None:
        eng = self.engine
        self._round_dirty = bool(self.first_dirty)
        self.first_dirty = 0.0
        incoming, pending = self.incoming, self.pending
        while incoming:
            for e in incoming.popleft():
                pending[e.name] = e
        joined = self.join_handle is not None
        words, _ = self.negotiator.build_words(pending, self._round_dirty, joined)
        if joined and self._join_round < 0:
            self._join_round = self.round
        timeline = eng.timeline
        if timeline is not None:
            timeline.mark_cycle()  # records only when the timeline was started with mark_cycles
        self._words = words
        self._req = self.control.start_band(words)
        self.state = _BAND

    def _finish_band(self) -> None:
        result, exchange = self.negotiator.decode(self._words)
        self._result = result
        if exchange:
            payload = self.negotiator.exchange_payload(self.pending, self.join_handle is not None)
            self._req = self.control.start_allgather(payload)
            self.state = _EXCHANGE
            return
        self._finish_round()

    def _finish_round(self) -> None:
        result = self._result
        negotiator = self.negotiator
        negotiator.reject_while_joined(result)
        negotiator.registry.touch(result.ready, self.round)
        self.round += 1
        self.continue_mode = result.any_dirty or bool(result.ready) or bool(result.errors)
        ready_entries: list[Entry] = []
        for name, message in result.errors.items():
            entry = self.pending.pop(name, None)
            if entry is not None:
                with self._names_lock:
                    self.inflight.pop(name, None)
                entry.handle.set_error(MismatchError(message))
        for name in self.negotiator.order(result.ready):
            entry = self.pending.pop(name, None)
            ready_entries.append(entry if entry is not None else self._phantom(name))
        self.state = _IDLE
        if ready_entries:
            self._dispatch(ready_entries)
        # Same names on every rank (use is counted in agreed rounds); after dispatch, which still reads them.
        negotiator.registry.evict(self.settings.cache_capacity)
        if result.all_joined:
            self._join_buf = np.array([self._join_round, self.rank], np.int64)
            self._join_all = np.empty(2 * self.size, np.int64)
            self._req = self.control.coll.Iallgather(self._join_buf, self._join_all)
            self.state = _JOINGATHER

    def _finish_join(self) -> None:
        rows = self._join_all.reshape(self.size, 2)
        last = int(max(range(self.size), key=lambda r: (rows[r, 0], r)))
        handle, self.join_handle = self.join_handle, None
        self._join_round = -1
        self.state = _IDLE
        if handle is not None:
            handle.set_result(self.world_ranks[last] if self.id == 0 else last)

    def _phantom(self, name: str) -> Entry:
        """Stand-in for an allreduce this joined rank did not submit: it contributes zeros, results are
        discarded. (While a rank is joined only allreduce runs: see Negotiator.reject_while_joined.)"""
        sig = self.negotiator.registry.signatures[self.negotiator.registry.index[name]]
        data = np.zeros(sig.shape, numpy_dtype(sig.dtype))
        return Entry(name=name, signature=sig, shape=sig.shape, input=None, output=data, process_set_id=self.id,
                     phantom=True)

    def _dispatch(self, entries: list[Entry]) -> None:
        tl = self.engine.timeline
        if tl is not None:
            for e in entries:
                if not e.phantom:
                    tl.negotiate_end(e)
        units = plan_units(entries, self.settings.fusion_threshold_bytes, self.settings.inplace_threshold_bytes,
                           self.size)
        n = len(self.channels)
        for unit in units:
            unit.index = self.unit_counter
            self.unit_counter += 1
            self.channels[unit.index % n].submit(unit)

    # -- completion (channel threads) ------------------------------------------------------------------
    def _entry_done(self, entry: Entry) -> None:
        # One critical section: an entry is either still counting down (dispatched) or gone from inflight,
        # never "finished but still listed", which fail_all(dispatched=False) relies on.
        with self._names_lock:
            entry.remaining -= 1
            finished = entry.remaining == 0
            if finished and not entry.phantom:
                self.inflight.pop(entry.name, None)
        if not finished:
            return
        if not entry.phantom:
            if self.engine.timeline is not None:
                self.engine.timeline.op_end(entry)
            entry.handle.set_result(entry)

    def _unit_failed(self, unit, exc: BaseException) -> None:
        names = ", ".join(p.entry.name for p in unit.pieces)
        if isinstance(exc, (NotImplementedError, PerseusInternalError)):
            message = f"perseus.{unit.op_type.name.lower()}({names}): {exc}"
        else:
            message = f"perseus.{unit.op_type.name.lower()}({names}) failed in the transport: " \
                      f"{type(exc).__name__}: {exc}"
        self.engine.abort(message, origin=self.engine.world_rank, exc_type=type(exc))

    # -- control messages, stalls, failure -------------------------------------------------------------
    def _poll_control(self, now: float) -> None:
        for source, msg in self.control.poll():
            kind = msg[0]
            if kind == "wake":
                self.woken_round = max(self.woken_round, msg[1])
            elif kind == "probe":
                with self._names_lock:
                    names = sorted(n for n, e in self.inflight.items() if e.remaining == 0)
                info = {"pending": names, "joined": self.join_handle is not None,
                        "round": self.round, "where": main_thread_location()}
                self.control.send(source, ("status", msg[1], info))
            elif kind == "status":
                if self._probe is not None and self._probe.probe_id == msg[1]:
                    self._probe.add(self.world_ranks[source], msg[2])
            elif kind == "abort":
                self.engine.abort(msg[2], origin=msg[1], propagate=False)
            elif kind == "shutdown":
                self._peer_shutdown(self.world_ranks[source])

    def _check_stall(self, now: float) -> None:
        s = self.settings
        if s.stall_check_disable or now - self._last_stall_check < _STALL_CHECK_S:
            return
        self._last_stall_check = now
        times = {n: e.submit_time for n, e in self.pending.items()}
        if not times:
            self._probe = None
            return
        oldest = min(times.values())
        waited = now - oldest
        shutdown_s = s.stall_shutdown_time_s
        due_shutdown = shutdown_s > 0 and waited >= shutdown_s
        if self._probe is None:
            warn_every = min(s.stall_check_time_s, shutdown_s) if shutdown_s > 0 else s.stall_check_time_s
            if waited < warn_every or now - self._last_warn < warn_every:
                return
            self._probe_counter += 1
            peers = [self.world_ranks[r] for r in range(self.size) if r != self.rank]
            self._probe = StallReport(self._probe_counter, peers, now + 5.0)
            self.control.broadcast_message(("probe", self._probe_counter))
            return
        if not (self._probe.complete or now >= self._probe.deadline):
            return
        report, self._probe = self._probe, None
        self._last_warn = now
        remaining = max(shutdown_s - waited, 0.0) if shutdown_s > 0 else None
        message = format_stall(self.engine.world_rank, times, report, now, remaining)
        if not message:
            return
        if due_shutdown:
            self.engine.abort(message + "\nShutting down: the stall lasted longer than the stall shutdown time.",
                              origin=self.engine.world_rank, exc_type=StallError)
        else:
            log.warning(message)

    def _peer_shutdown(self, world_rank: int) -> None:
        reason = (f"perseus: rank {world_rank} shut down (perseus.shutdown() or process exit) while this rank "
                  f"still used process set {self.id}; every rank must call the same collectives before exiting.")
        self.dead = reason
        # Requests already dispatched to channels stay: the peer drained its channels, so it took part in
        # those collectives before it said so. Only what was never negotiated can no longer complete.
        self.fail_all(PerseusInternalError(reason), dispatched=False)

    def fail_all(self, error: BaseException, dispatched: bool = True) -> None:
        """Fail pending requests of this set (and, with ``dispatched``, those already in channels too).

        Called from any thread; the set is unusable afterwards and the engine thread ignores its pending
        entries. Entries in channels have ``remaining > 0`` until they complete.
        """
        with self._names_lock:
            entries = [e for e in self.inflight.values() if dispatched or e.remaining == 0]
            for e in entries:
                del self.inflight[e.name]
        join, self.join_handle = self.join_handle, None
        for e in entries:
            e.handle.set_error(error)
        if join is not None:
            join.set_error(error)

    def close(self, notify_peers: bool) -> bool:
        """Stop the channels; return False if one is stuck in a collective that peers will never finish."""
        timeout = 5.0 if self.dead is None else 0.5
        # Drain the channels first: by the time peers hear of the shutdown, this rank has taken part in every
        # collective it had agreed to.
        clean = all([ch.stop(timeout) for ch in self.channels])
        if notify_peers:
            self.control.broadcast_message(("shutdown",))
            self.control.flush_sends()
        return clean
