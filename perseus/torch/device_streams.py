"""The stream shim of the device launcher (:mod:`perseus.torch.device`): the ordering between the callers'
streams and the launcher's, one object per kind of memory.

On a GPU (:class:`CudaStreams`) each process group has its own stream, the launcher's work waits for events
recorded on the callers' streams at submission, and completion is stream-ordered: ``synchronize`` makes the
caller's current stream wait for the unit's done event instead of the host waiting. In host memory
(:class:`HostStreams`, the gloo backend) work is synchronous and nothing needs ordering. Nothing here
communicates or raises on its own; CUDA errors surface from torch's calls.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

__all__ = ["Streams", "HostStreams", "CudaStreams"]


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
