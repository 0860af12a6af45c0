"""A sparse reduction in flight: its handle, its result, and the worker thread its later stages run on.

:class:`SparseHandle` is what ``sparse_allreduce_async`` returns: :meth:`SparseHandle.wait` returns the
:class:`SparseResult` or raises what the reduction raised (MismatchError when the ranks disagree about the
tensor, PerseusInternalError when the job failed or perseus was shut down). The first collective of a
reduction is submitted on the caller's thread; each later stage runs on the one perseus-sparse worker thread
(``_worker``) once the engine reports the previous collective done.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Optional

from perseus.runtime.state import runtime
from perseus.base.exceptions import PerseusInternalError

log = logging.getLogger("perseus")

__all__ = ["SparseResult", "SparseHandle"]


class SparseResult:
    """The reduced sparse tensor: ``rows`` (int64) and ``values`` (``len(rows)`` rows, flattened to
    ``(len(rows), W)``). ``coalesced``: rows sorted and unique (every algorithm but allgather, whose rows are
    every rank's rows concatenated in rank order, as Horovod returns them)."""

    __slots__ = ("rows", "values", "coalesced", "algorithm")

    def __init__(self, rows, values, coalesced, algorithm):
        self.rows, self.values, self.coalesced, self.algorithm = rows, values, coalesced, algorithm

    def __repr__(self) -> str:
        return f"SparseResult({self.rows.size} rows, algorithm={self.algorithm!r}, coalesced={self.coalesced})"


class SparseHandle:
    """An in-flight sparse reduction. :meth:`wait` returns its :class:`SparseResult` (or raises what it
    raised, on every call); :meth:`on_done` calls back when it has finished."""

    __slots__ = ("name", "algorithm", "_event", "_lock", "_result", "_error", "_callbacks", "_engine")

    def __init__(self, name: str, algorithm: str, engine=None):
        self.name, self.algorithm = name, algorithm
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._result = self._error = None
        self._callbacks: list = []
        self._engine = engine

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self) -> SparseResult:
        """The result; raises what the reduction raised (MismatchError when the ranks disagree about the
        tensor, PerseusInternalError when the job failed)."""
        while not self._event.wait(1.0):
            failure = self._engine_failure()
            if failure is not None:
                self._resolve(error=failure)
        if self._error is not None:
            raise self._error
        return self._result

    def _engine_failure(self):
        engine = self._engine
        if engine is None:
            return None
        if runtime().active_engine is not engine:
            return PerseusInternalError(f"perseus.sparse_allreduce({self.name!r}): perseus was shut down")
        message = engine.failed
        return None if message is None else PerseusInternalError(f"perseus.sparse_allreduce({self.name!r}): "
                                                                 f"{message}")

    def on_done(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(callback)
                return
        callback()

    def _resolve(self, result=None, error=None) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self._result, self._error = result, error
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            try:
                cb()
            except Exception:  # noqa: BLE001 - a callback's failure must not stop the others
                log.exception("perseus.sparse: a completion callback failed")

    def __repr__(self) -> str:
        return f"SparseHandle({self.name!r}, {self.algorithm}, {'done' if self.done() else 'in flight'})"


# -- the stage worker -----------------------------------------------------------------------------------------
class _Worker:
    def __init__(self):
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def put(self, fn: Callable[[], None]) -> None:
        if self._thread is None or not self._thread.is_alive():
            with self._lock:
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(target=self._run, name="perseus-sparse", daemon=True)
                    self._thread.start()
        self._queue.put(fn)

    def _run(self) -> None:
        while True:
            fn = self._queue.get()
            try:
                fn()
            except BaseException:  # noqa: BLE001 - stages report their own errors; never let the thread die
                log.exception("perseus.sparse: a stage failed outside its handle")


_worker = _Worker()
