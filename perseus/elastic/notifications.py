"""Host-change notifications for the ranks of an elastic job.

The rank's session with the elastic launcher (:mod:`perseus.elastic.worker`) is the notification source: it
calls ``notification_manager.handle_hosts_updated(timestamp, update)`` when the launcher's driver reports a
change, and every ``State`` registered by a running ``run`` loop (:mod:`perseus.elastic.state`) queues it for
its next ``commit()``/``check_host_updates()``. In a job without the launcher no source is installed and no
notification ever arrives.
"""

from __future__ import annotations

import threading
from enum import IntFlag
from typing import Callable, Optional

__all__ = ["HostUpdateResult", "WorkerNotificationManager", "notification_manager", "set_notification_source",
           "has_notification_source"]


class HostUpdateResult(IntFlag):
    """What changed in the set of hosts (as Horovod's ``horovod.runner.elastic.worker.HostUpdateResult``)."""

    no_update = 0
    removed = 1
    added = 2
    mixed = removed | added


_source_factory: Optional[Callable[["WorkerNotificationManager"], object]] = None


def set_notification_source(factory: Optional[Callable[["WorkerNotificationManager"], object]]) -> None:
    """Install how this worker hears about host changes (for an elastic launcher; ``None`` removes it).

    ``factory(manager)`` is called once, by the first ``run`` loop to start, and returns the running source
    (kept alive by the manager). The source calls ``manager.handle_hosts_updated(timestamp, update)`` for every
    change the launcher's driver reports.
    """
    global _source_factory
    _source_factory = factory


class WorkerNotificationManager:
    """Hands host-change notifications to the :class:`State` objects of running ``run`` loops."""

    def __init__(self):
        self._lock = threading.Lock()
        self._listeners: set = set()
        self._source = None

    def init(self) -> None:
        """Start the notification source if one is installed and not yet started (no-op in a static job)."""
        with self._lock:
            if self._source is None and _source_factory is not None:
                self._source = _source_factory(self)

    @property
    def attached(self) -> bool:
        """True once an elastic launcher's notification source is running in this process."""
        return self._source is not None

    def register_listener(self, listener) -> None:
        with self._lock:
            self._listeners.add(listener)

    def remove_listener(self, listener) -> None:
        with self._lock:
            self._listeners.discard(listener)

    def handle_hosts_updated(self, timestamp, update_res=HostUpdateResult.no_update) -> None:
        """Called by the notification source: pass the change to every registered state."""
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener.on_hosts_updated(timestamp, update_res)

    def _detach(self) -> None:
        """Forget the running source (tests; a launcher shutting its source down)."""
        with self._lock:
            self._source = None


notification_manager = WorkerNotificationManager()


def has_notification_source() -> bool:
    """Whether a notification source is installed (:func:`set_notification_source`)."""
    return _source_factory is not None
