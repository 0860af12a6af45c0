"""The engine: one background thread per process that drives every process set's negotiation.

Framework adapters call :meth:`Engine.enqueue` from their own threads and get a :class:`Handle`; they never
block on the network unless they wait on the handle. The engine thread sleeps on a condition variable when no
process set has work, and test-then-sleeps while it waits for peers, so an idle engine costs nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from perseus.common.exceptions import PerseusInternalError
from perseus.engine.messages import Entry, Handle
from perseus.engine.runtime import ProcessSetRuntime
from perseus.transport.mpi import Sleeper, tighten_timer_slack

__all__ = ["Engine"]

log = logging.getLogger("perseus")


class Engine:
    """Background negotiation and dispatch for all process sets of this process."""

    def __init__(self, settings, world_rank: int, timeline=None):
        self.settings = settings
        self.world_rank = world_rank
        self.timeline = timeline
        self.cond = threading.Condition()
        self.sets: dict[int, ProcessSetRuntime] = {}
        self.failed: Optional[BaseException] = None
        self._stop = False
        self.clean = True  # False once a channel thread was left inside a collective at shutdown
        self._submissions = 0  # bumped by every submission; the engine re-checks it before waiting
        self._idle = False  # the engine thread is (about to be) waiting on cond; submitters must notify
        self._thread = threading.Thread(target=self._run, name="perseus-engine", daemon=True)
        self._started = False

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> None:
        self._started = True
        self._thread.start()

    def add_process_set(self, ps_id: int, comm, world_ranks: list[int]) -> None:
        """Create the runtime of a process set this rank belongs to. Collective over ``comm``."""
        runtime = ProcessSetRuntime(self, ps_id, comm, world_ranks)
        with self.cond:
            self.sets[ps_id] = runtime
            self.cond.notify()

    def remove_process_set(self, ps_id: int) -> None:
        with self.cond:
            runtime = self.sets.pop(ps_id, None)
        if runtime is not None:
            runtime.fail_all(PerseusInternalError(f"perseus: process set {ps_id} was removed"))
            runtime.close(notify_peers=False)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the engine thread; fail what is still pending; tell peers this rank has shut down."""
        with self.cond:
            self._stop = True
            self.cond.notify()
        if self._started:
            self._thread.join(timeout_s)
        else:
            self._close_all()

    # -- requests --------------------------------------------------------------------------------------
    def enqueue(self, entries: list[Entry], ps_id: int = 0) -> list[Handle]:
        """Queue requests (atomically, so a group is negotiated together); return their handles.

        Raises:
            ValueError: a name is already in flight on this rank, or the process set is unknown here.
            PerseusInternalError: the engine has failed or shut down.
        """
        if self.failed is not None:
            raise PerseusInternalError(str(self.failed))
        if self._stop:
            raise PerseusInternalError("perseus has been shut down; call init() again to use it")
        runtime = self._runtime(ps_id)
        timeline = self.timeline
        if timeline is not None:
            for e in entries:
                timeline.negotiate_start(e)
        runtime.submit(entries)
        self._wake()
        return [e.handle for e in entries]

    def join(self, ps_id: int = 0) -> Handle:
        if self.failed is not None:
            raise PerseusInternalError(str(self.failed))
        handle = Handle()
        self._runtime(ps_id).submit_join(handle)
        self._wake()
        return handle

    def _wake(self) -> None:
        # Lock-free unless the engine thread is waiting: it sets _idle under cond and re-checks for work
        # before it waits, so a submission either is seen by that check or finds _idle set and notifies.
        self._submissions += 1
        if self._idle:
            with self.cond:
                self.cond.notify()

    def _runtime(self, ps_id: int) -> ProcessSetRuntime:
        try:
            return self.sets[ps_id]
        except KeyError:
            raise ValueError(f"perseus: process set {ps_id} is not registered on this rank "
                             f"(this rank is not a member, or the set was removed)") from None

    # -- failure ---------------------------------------------------------------------------------------
    def abort(self, message: str, origin: int, propagate: bool = True,
              exc_type: type = PerseusInternalError) -> None:
        """Fail every request on this rank and, when ``propagate``, on every other rank too."""
        if origin != self.world_rank:
            message = f"perseus: rank {origin} failed and stopped the job: {message}"
        error = exc_type(message) if issubclass(exc_type, PerseusInternalError) else PerseusInternalError(message)
        with self.cond:
            first = self.failed is None
            if first:
                self.failed = error
            runtimes = list(self.sets.values())
            self.cond.notify()
        if not first:
            return
        log.error(message)
        if propagate and 0 in self.sets:
            self.sets[0].control.broadcast_message(("abort", origin, message))
        for rt in runtimes:
            rt.dead = message
            rt.fail_all(error)

    # -- the thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        tighten_timer_slack()
        busy_sleep = Sleeper(20e-6, 1e-3)
        idle_wait = 1e-3
        try:
            while True:
                with self.cond:
                    if self._stop:
                        break
                    runtimes = list(self.sets.values())
                seen = self._submissions
                now = time.monotonic()
                progressed = waiting = False
                deadline = float("inf")
                for rt in runtimes:
                    p, w, d = rt.step(now)
                    progressed |= p
                    waiting |= w
                    deadline = min(deadline, d)
                if progressed:
                    busy_sleep.reset()
                    idle_wait = 1e-3
                    continue
                if waiting:
                    busy_sleep.sleep()
                    continue
                with self.cond:
                    self._idle = True
                    if self._stop:
                        break
                    if self._submissions != seen:  # work arrived after this iteration looked
                        self._idle = False
                        continue
                    has_work = any(rt.has_work() for rt in runtimes)
                    cap = 1e-3 if has_work else self.settings.idle_poll_max_ms * 1e-3
                    timeout = max(min(deadline - time.monotonic(), idle_wait, cap), 0.0)
                    self.cond.wait(timeout)
                    self._idle = False
                    idle_wait = min(idle_wait * 2, cap)
        except BaseException as exc:  # noqa: BLE001 - an engine bug must fail every rank, not hang them
            log.exception("perseus engine thread failed")
            self.abort(f"perseus engine thread failed: {type(exc).__name__}: {exc}", origin=self.world_rank)
        finally:
            self._close_all()

    def _close_all(self) -> None:
        with self.cond:
            runtimes = list(self.sets.values())
            self.sets.clear()
        for rt in runtimes:
            rt.fail_all(PerseusInternalError("perseus has been shut down"))
            if not rt.close(notify_peers=self.failed is None):
                self.clean = False
