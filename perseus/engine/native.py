"""The native core (:mod:`perseus._core`): loading it, and the engine object the rest of perseus uses.

The core (C++ in ``native/``) owns the per-request path: queue, negotiation, fusion, channels, the MPI calls
and completion. This module starts and stops it, turns its errors into perseus's exception types, and
connects the two things only Python can do: where the main thread is (for stall reports) and logging.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from perseus.base.exceptions import MismatchError, PerseusInternalError, StallError
from perseus.engine.messages import DType, OpType, Request
from perseus.engine.settings import ENGINE_FIELDS, ENGINE_SETTINGS, engine_values
from perseus.engine.stall import main_thread_location
from perseus.transport.mpi import load_mpi

__all__ = ["load_core", "Engine", "ENGINE_SETTINGS", "core_settings"]

log = logging.getLogger("perseus")

_core = None


def load_core():
    """Import the native core (after MPI, whose library it links against).

    Raises:
        ImportError: the core was not built (or not for this MPI); the message says how to fix it.
    """
    global _core
    if _core is not None:
        return _core
    MPI = load_mpi()
    try:
        # Imported here, not at module level: the compiled core links against the MPI library, which
        # load_mpi() has just loaded, and a core built for another MPI must fail with this message.
        from perseus import _core as core
    except ImportError as exc:
        raise ImportError(
            f"perseus's native core could not be loaded ({exc}). It is compiled when perseus is installed; "
            "reinstall it where a C++17 compiler and an MPI are available (pip install --force-reinstall "
            "--no-deps perseus, or pip install -e . in a checkout). The MPI must be the one mpi4py uses "
            f"(now: {MPI.Get_library_version().splitlines()[0]}).") from exc
    built = core.mpi_library_version().splitlines()[0]
    running = MPI.Get_library_version().splitlines()[0]
    if _flavour(built) != _flavour(running):
        raise ImportError(f"perseus's native core was built against {built!r} but mpi4py runs {running!r}; "
                          "reinstall perseus (pip install --force-reinstall --no-deps perseus) with the MPI you "
                          "use now.")
    _core = core
    return core


def _flavour(version: str) -> str:
    if "Open MPI" in version:
        return "openmpi"
    if "MPICH" in version or "Intel" in version:
        return "mpich"
    return version


def _log(level: int, message: str) -> None:
    log.log(level, message)


def core_settings(core, settings, **per_rank: Any):
    """The core's ``Settings`` struct (:mod:`perseus.engine.settings`), every field filled from the resolved
    knobs ``settings`` and ``per_rank`` (``host_key``, ``cpu_core``; None or absent: the field's default).

    Raises:
        ValueError: a knob value the engine cannot use (an unknown algorithm).
        TypeError: a value of the wrong type for its field (the message names the field and its knobs).
    """
    values = engine_values(settings, **per_rank)
    values["algorithm"] = core.Algorithm.__members__[values["algorithm"].upper()]
    out = core.Settings()
    for field in ENGINE_FIELDS:
        try:
            setattr(out, field.name, values[field.name])
        except TypeError:
            source = f"setting {', '.join(field.knobs)}" if field.knobs else f"per-rank setting {field.name}"
            raise TypeError(f"perseus {source}: {values[field.name]!r} is not a valid {field.ctype} for the "
                            f"engine's {field.name}") from None
    return out


class Engine:
    """One native engine per process: every process set's negotiation and channels.

    Errors raised by its methods: ``ValueError`` (a duplicate in-flight name, an unknown process set),
    :class:`PerseusInternalError` (the job failed or shut down), :class:`MismatchError` (ranks disagree on
    a tensor), :class:`StallError` (a stall outlasted the stall shutdown time).
    """

    def __init__(self, settings, world_rank: int, host_key: Optional[int] = None, cpu_core: Optional[int] = None):
        """Create (not start) the engine of this rank from the resolved knobs ``settings`` (a
        :class:`perseus.base.knobs.Settings`, or any object with the knobs of :data:`ENGINE_SETTINGS`).
        ``host_key``: ranks with equal keys share a host; ``cpu_core``: pin the engine thread to this core
        (None: the field's default in perseus.engine.settings: one host, no pinning). The engine reads its settings
        only here. Raises ValueError or TypeError for a value the engine cannot use (see core_settings)."""
        core = load_core()
        self.world_rank = world_rank
        self._timeline = None
        self._native = core.Engine(core_settings(core, settings, host_key=host_key, cpu_core=cpu_core), world_rank,
                                   main_thread_location, _log, (PerseusInternalError, MismatchError, StallError))
        # The hot-path methods, bound once.
        self.submit: Callable[..., int] = self._native.submit
        self.submit_one: Callable[..., int] = self._native.submit_one
        self.wait: Callable[..., Any] = self._native.wait
        self.poll: Callable[[int], bool] = self._native.poll
        self.on_done = self._native.on_done
        self.params = self._native.params
        self.steps = self._native.steps

    def start(self) -> None:
        self._native.start()

    def add_process_set(self, ps_id: int, comm, world_ranks: list[int]) -> None:
        """Create the runtime of a process set this rank belongs to. Collective over ``comm``."""
        self._native.add_process_set(ps_id, int(comm.handle), list(world_ranks))

    def add_loopback_process_set(self, ps_id: int, world, rank: int, world_ranks: list[int]) -> None:
        """Tests: a process set whose ranks are threads of this process (see ``perseus._core.LoopbackWorld``)."""
        self._native.add_loopback_process_set(ps_id, world, rank, list(world_ranks))

    def tune(self, ps_id: int, name: str, fusion_threshold_bytes: int, inplace_threshold_bytes: int, channels: int,
             cycle_time_us: int, algorithm: int, device_bucket_bytes: Optional[int] = None) -> int:
        """Submit a request that changes the set's run-time parameters; returns its handle.
        ``device_bucket_bytes`` (None: unchanged) is the device buckets' budget (0: none); a new one makes the
        engine learn its buckets again from the next step. -1 for any value keeps it as it is.

        Every rank of the set must submit it with the same name and values (a difference is a
        MismatchError on every rank). It takes effect after the units of the negotiation round in which
        it becomes ready on every rank, so every rank switches at the same point. Values out of range
        (channels above those created) fail the request with ValueError on every rank.
        """
        # The values travel as the shape: negotiation compares them across ranks.
        values = (int(fusion_threshold_bytes), int(inplace_threshold_bytes), int(channels), int(cycle_time_us),
                  int(algorithm))
        if device_bucket_bytes is not None:
            values += (int(device_bucket_bytes),)
        item = Request(name=name, dtype=DType.UINT8, shape=values)
        return self._native.submit(ps_id, int(OpType.TUNE), [item], None, None)

    def remove_process_set(self, ps_id: int) -> None:
        self._native.remove_process_set(ps_id)

    def wire_bytes(self, ps_id: int = 0) -> dict[str, int]:
        """Bytes this rank has sent and received for process set ``ps_id`` since it was created:
        ``sent_bytes`` and ``received_bytes`` (collective payload), ``control_sent_bytes`` and
        ``control_received_bytes`` (negotiation and everything else). Reads relaxed atomic counters; never
        waits for the engine.

        Raises:
            ValueError: no process set ``ps_id`` on this rank.
        """
        return self._native.wire_bytes(ps_id)

    def open_requests(self) -> int:
        """Collective requests submitted on this rank and not finished yet, over every process set: 0 when
        perseus has nothing on the network. Reads a relaxed atomic counter; never waits for the engine."""
        return self._native.open_requests()

    def join(self, ps_id: int = 0) -> int:
        return self._native.join(ps_id)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the engine; fail what is still pending; tell peers this rank has shut down."""
        self._native.shutdown(timeout_s)
        self.timeline = None

    @property
    def clean(self) -> bool:
        """False once a channel thread was left inside a collective at shutdown."""
        return self._native.clean

    @property
    def failed(self) -> Optional[str]:
        state = self._native.failed()
        return None if state is None else state[1]

    def abort(self, message: str) -> None:
        """Fail every request on every rank with ``message``."""
        self._native.abort(message)

    def clear_handles(self) -> None:
        self._native.clear_handles()

    # -- timeline --------------------------------------------------------------------------------------
    @property
    def timeline(self):
        return self._timeline

    @timeline.setter
    def timeline(self, timeline) -> None:
        """Record engine events into ``timeline`` (a :class:`perseus.timeline.writer.Timeline`), or stop."""
        old, self._timeline = self._timeline, timeline
        if old is not None and old is not timeline:
            old.detach()
        self._native.set_timeline(timeline is not None)
        if timeline is not None:
            timeline.attach(self._native.drain_timeline, counters=lambda: self._native.wire_bytes(0))
