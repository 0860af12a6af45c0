"""Background snapshots of a ``TorchState``: the copy of a commit's tensors overlaps the next forward and
backward passes instead of stopping the training for it.

A commit copies every tensor of the state into buffers kept from commit to commit (two sets, used in turn, so
the set the keepers may still be reading is never written). Tensors that only an optimizer of the state changes
-- its parameters and its own state (momentum, Adam moments) -- are copied by a background thread while the
training goes on; the optimizer's ``step()`` waits for that copy first (a step pre-hook), so the snapshot is
exactly the state at ``commit()``. Everything else (buffers such as BatchNorm's running statistics, which the
forward pass changes, and plain Python values) is copied at once. Work queued after a snapshot (the Gemini
copy to the keepers) runs on the same thread, in order.

``PERSEUS_ELASTIC_SNAPSHOT=sync`` copies everything at ``commit()``; so does a DeAR optimizer, which changes
parameters during the forward pass.

Under the elastic launcher the buffers are files in shared memory (:mod:`perseus.base.elastic_shm`): the host's
checkpoint keeper maps them instead of receiving a copy.
"""

from __future__ import annotations

import collections
import copy
import logging
import threading
from typing import Callable, Optional

import torch

__all__ = ["Snapshotter", "Copier"]

log = logging.getLogger("perseus.elastic")

_NUMPY_DTYPES = {t: torch.empty(0, dtype=t).numpy().dtype for t in (
    torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
    torch.bool)}


class Copier:
    """Copies one snapshot's tensors into the buffers of ``pool`` (allocated on first use, then reused); the
    copies asked ``deferred`` are left to the background thread."""

    def __init__(self, pool: dict, prefix: tuple = (), arena=None):
        self.pool, self.prefix, self.arena = pool, prefix, arena
        self.jobs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def scoped(self, name) -> "Copier":
        child = Copier(self.pool, self.prefix + (name,), self.arena)
        child.jobs = self.jobs
        return child

    def _buffer(self, key, value: torch.Tensor) -> torch.Tensor:
        """The pool's buffer for ``key``, (re)allocated to ``value``'s shape and dtype: in the shared-memory
        arena when there is one and NumPy has the dtype, else in ordinary memory."""
        held = self.pool.get(key)
        if held is not None and held[0].shape == value.shape and held[0].dtype == value.dtype:
            return held[0]
        if held is not None and held[1] is not None:
            self.arena.release(held[1])
        array = None
        if self.arena is not None and value.dtype in _NUMPY_DTYPES:
            try:
                array = self.arena.allocate(tuple(value.shape), _NUMPY_DTYPES[value.dtype])
            except OSError as exc:  # /dev/shm full: ordinary memory, the keeper gets a sent copy
                log.warning("perseus elastic: no shared memory for a snapshot buffer (%s)", exc)
        buf = torch.from_numpy(array) if array is not None else torch.empty(value.shape, dtype=value.dtype)
        self.pool[key] = (buf, array)
        return buf

    def tensor(self, key, value: torch.Tensor, deferred: bool) -> torch.Tensor:
        """A snapshot of ``value`` in this pool's buffer for ``key``: filled now, or later when ``deferred``."""
        if value.device.type != "cpu" or value.is_sparse or value.is_quantized or value.requires_grad:
            return copy.deepcopy(value)
        buf = self._buffer(self.prefix + (key,), value)
        if deferred:
            self.jobs.append((buf, value))
        else:
            buf.copy_(value)
        return buf

    def tree(self, key, value, deferred: Callable[[torch.Tensor], bool]):
        """``value`` (dicts, lists and tuples of tensors and plain values) with every tensor snapshotted and
        every other leaf deep-copied; ``deferred(t)`` says which tensors may be copied in the background."""
        if isinstance(value, torch.Tensor):
            return self.tensor(key, value, deferred(value))
        if isinstance(value, dict):
            items = {k: self.scoped(key).tree(k, v, deferred) for k, v in value.items()}
            if type(value) is dict:
                return items
            out = type(value)(items)
            metadata = getattr(value, "_metadata", None)
            if metadata is not None:
                out._metadata = copy.deepcopy(metadata)
            return out
        if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
            return type(value)(self.scoped(key).tree(i, v, deferred) for i, v in enumerate(value))
        return copy.deepcopy(value)


class Snapshotter:
    """The background thread and the two buffer pools of one state (see the module doc)."""

    def __init__(self):
        self._pools = ({}, {})
        self._slot = 0
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._copies_pending = 0
        self._busy = False
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None

    def begin(self, hurry: Optional[Callable[[], None]] = None, arena=None) -> Copier:
        """Wait for everything queued (calling ``hurry()`` first if that means waiting), then hand out the
        pool not used by the previous snapshot; ``arena``: where new buffers go (shared memory)."""
        with self._cond:
            waiting = bool(self._queue) or self._busy
        if waiting and hurry is not None:
            hurry()
        self.wait()
        self._slot ^= 1
        return Copier(self._pools[self._slot], arena=arena)

    def launch(self, copier: Copier) -> None:
        """Queue ``copier``'s deferred copies."""
        if not copier.jobs:
            return
        with self._cond:
            self._copies_pending += 1
            self._queue.append(("copy", copier.jobs))
            self._start()
            self._cond.notify_all()

    def after(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the background thread once everything queued before it is done."""
        with self._cond:
            self._queue.append(("call", fn))
            self._start()
            self._cond.notify_all()

    def wait_copied(self) -> None:
        """Wait until every queued copy is done (before anything changes the tensors being copied)."""
        with self._cond:
            while self._copies_pending:
                self._cond.wait()
        self._raise()

    def wait(self) -> None:
        """Wait until the queue is empty and the thread idle."""
        with self._cond:
            while self._queue or self._busy:
                self._cond.wait()
        self._raise()

    def _raise(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"perseus elastic: the background snapshot failed: {error}") from error

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="perseus-elastic-snapshot", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                kind, work = self._queue.popleft()
                self._busy = True
            try:
                if kind == "copy":
                    with torch.no_grad():
                        for dst, src in work:
                            dst.copy_(src)
                else:
                    work()
            except BaseException as exc:  # noqa: BLE001 - reported to the training thread at its next wait
                log.warning("perseus elastic: background snapshot work failed: %s", exc)
                self._error = exc
            finally:
                with self._cond:
                    if kind == "copy":
                        self._copies_pending -= 1
                    self._busy = False
                    self._cond.notify_all()
