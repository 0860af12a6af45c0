"""Integer handles for asynchronous requests, as Horovod's ``*_async`` functions return them."""

from __future__ import annotations

import threading
from typing import Any, Callable

from perseus.engine.messages import Handle

__all__ = ["HandleTable"]


class HandleTable:
    """Maps an int to the engine handles of one call and the function that builds its result."""

    def __init__(self):
        self._lock = threading.Lock()
        self._next = 0
        self._map: dict[int, tuple[list[Handle], Callable[[list], Any]]] = {}

    def next_id(self) -> int:
        with self._lock:
            self._next += 1
            return self._next

    def register(self, handles: list[Handle], finish: Callable[[list], Any], hid: int | None = None) -> int:
        """Store ``handles``; ``finish(results)`` builds what :meth:`synchronize` returns."""
        if hid is None:
            hid = self.next_id()
        with self._lock:
            self._map[hid] = (handles, finish)
        return hid

    def poll(self, hid: int) -> bool:
        """True when every request of ``hid`` has finished (successfully or not).

        Raises:
            ValueError: ``hid`` is not a live handle.
        """
        with self._lock:
            item = self._map.get(hid)
        if item is None:
            raise ValueError(f"perseus.poll(): unknown handle {hid!r} (already synchronized, or never issued)")
        return all(h.done() for h in item[0])

    def on_done(self, hids: list[int], callback: Callable[[], None]) -> None:
        """Call ``callback()`` once every request of every id in ``hids`` has finished (at once if they have;
        otherwise on the engine thread that finishes the last one). Unknown ids count as finished."""
        with self._lock:
            handles = [h for hid in hids for h in self._map.get(hid, ([], None))[0]]
        remaining = [len(handles)]
        lock = threading.Lock()

        def one(_handle):
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                callback()
        if not handles:
            callback()
        for h in handles:
            h.add_callback(one)

    def synchronize(self, hid: int) -> Any:
        """Wait for ``hid`` and return its result; None for an unknown handle (as Horovod does).

        Raises:
            PerseusInternalError: the collective failed on this or another rank.
        """
        with self._lock:
            item = self._map.get(hid)
        if item is None:
            return None
        handles, finish = item
        try:
            results = [h.wait() for h in handles]
        finally:
            with self._lock:
                self._map.pop(hid, None)
        return finish(results)

    def clear(self) -> None:
        with self._lock:
            self._map.clear()
