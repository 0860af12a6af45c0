"""Starting perseus on every rank of a job, all or nothing.

``init()`` is collective, and MPI gives a rank that fails half-way through it no way to reach the ranks that
already wait inside a collective call: they would wait for ever, and the failed rank with them (MPI's
finalisation at exit waits for the others too). So start-up alternates three kinds of phase:

* **local** phases do everything that can fail on one rank alone: reading the settings, loading the native
  core, opening the timeline or tuning-log file, importing optional dependencies, checking process sets. A
  failure is kept, not raised;
* a **vote** (:func:`agree`) that every rank reaches: one allgather of each rank's failure, if any. When one
  rank failed, every rank raises, naming the ranks and their errors, with nothing left running, so the job
  ends (or ``init()`` may be called again);
* **collective** phases (duplicating communicators, the topology exchange, creating the channels and their
  links) can only fail where MPI or the network fails under them. A rank that fails inside one aborts the
  MPI job (:func:`abort_job`) with a message saying where, since nothing else would reach the others.

This module also declares :class:`Topology` (where a rank sits, exchanged by :func:`topology`) and the
:class:`Service` protocol of what the runtime starts and stops in these phases, and keeps the small pieces of
start-up that only :mod:`perseus.runtime.state` uses.
"""

from __future__ import annotations

import builtins
import logging
import os
import sys
import time
import traceback
from typing import Any, NamedTuple, Optional, Protocol, Sequence

from perseus.base.knobs import Settings
from perseus.engine.settings import topology_channels
from perseus.transport.mpi import load_mpi

__all__ = ["Topology", "Service", "affinity_cores", "await_every_rank", "agree", "abort_job", "topology",
           "choose_by_topology", "configure_logging", "warn_ignored_settings", "install_abort_hook"]


class Topology(NamedTuple):
    """Where this rank sits in the job (exchanged once at start-up, :func:`perseus.runtime.startup.topology`)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1
    homogeneous: bool = True
    host_key: int = 0


class Service(Protocol):
    """Something built on the runtime that starts and stops with it (the run-time tuner).

    ``name`` identifies it (:meth:`Runtime.service`). ``configure(settings, size)`` runs in start-up's first
    local phase, before the engine exists: it may adjust ``settings`` and raises to fail ``init()`` on every
    rank; ``prepare(engine, settings, topology)`` runs in the
    second local phase and returns the object to start (or None: nothing to run in this job), whose
    ``start()`` is called in the second collective phase and ``stop()`` at shutdown, before the engine stops.
    """

    name: str

    def configure(self, settings: Settings, size: int) -> None: ...

    def prepare(self, engine, settings: Settings, topology: Topology): ...


def _describe(exc: BaseException) -> tuple[str, str, tuple[str, ...]]:
    """(type name, message, names of the type's classes) of ``exc``: what a vote carries to the other ranks."""
    return type(exc).__name__, str(exc), tuple(c.__name__ for c in type(exc).__mro__)


def _exception_type(classes: Sequence[str]) -> type:
    """The nearest built-in exception class among ``classes`` (a failing rank's type and its bases), so that
    every rank raises an exception a caller can catch the same way (``except ValueError`` on every rank)."""
    for name in classes:
        candidate = getattr(builtins, name, None)
        if isinstance(candidate, type) and issubclass(candidate, Exception):
            return candidate
    return RuntimeError


def await_every_rank(comm, timeout_s: float) -> None:
    """Return once every rank of ``comm`` has called this (a non-blocking barrier, polled); abort the job when
    ``timeout_s`` (> 0) passes first: a rank that failed or exited before init() never arrives, and the
    others would wait in init()'s first collective call for ever.

    Collective: every rank of ``comm`` must call it, first thing in init().
    """
    request = comm.Ibarrier()
    deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
    pause = 0.0005
    while not request.Test():
        if deadline is not None and time.monotonic() > deadline:
            sys.stderr.write(
                f"perseus: rank {comm.Get_rank()} waited {timeout_s:g} s in init() for the other ranks of the job "
                f"({comm.Get_size()} in all) and not every one has called it: a rank that failed or exited before "
                "init() never will (its output says why). Aborting the MPI job so that no rank waits for ever; "
                "PERSEUS_INIT_TIMEOUT_SECONDS sets this wait (0: no limit).\n")
            sys.stderr.flush()
            comm.Abort(1)
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def agree(comm, what: str, error: Optional[BaseException], payload: Any = None) -> list:
    """Vote on whether every rank of ``comm`` got through a local phase of start-up.

    Collective: every rank of ``comm`` must call it once per phase, whether or not its phase failed.

    Args:
        comm: the mpi4py communicator of the ranks starting together.
        what: the phase, for the message ("reading settings and loading the native core").
        error: this rank's failure in the phase, or None.
        payload: any picklable value to share; the payloads of every rank are returned.

    Returns:
        The payloads, in rank order, when no rank failed.

    Raises:
        The failing rank's exception type (on that rank) or the nearest built-in type of the first failing
        rank's exception (on the others), with one message naming every failing rank and its error, on every
        rank. The failing rank's own traceback is chained to it, except for a ValueError, ImportError,
        OSError or NotImplementedError (a setting, a module, a file: the message says it all).
    """
    votes = comm.allgather((None if error is None else _describe(error), payload))
    failed = [(rank, vote) for rank, (vote, _) in enumerate(votes) if vote is not None]
    if not failed:
        return [p for _, p in votes]
    size = comm.Get_size()
    by_error: dict[str, list[int]] = {}  # the same error on several ranks is said once
    for rank, (name, text, _) in failed:
        by_error.setdefault(f"{name}: {text}", []).append(rank)
    if len(by_error) == 1 and len(failed) == size:
        lines = next(iter(by_error))
    else:
        lines = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {e}"
                          for e, r in by_error.items())
    who = ("every rank" if len(failed) == size else
           f"rank{'s' if len(failed) > 1 else ''} {', '.join(str(r) for r, _ in failed)} of {size}")
    message = (f"perseus.init() failed on {who} while {what} ({lines}). No rank started; fix the cause and "
               "start the job (or init()) again.")
    cls = type(error) if error is not None else _exception_type(failed[0][1][2])
    try:
        raised = cls(message)
    except Exception:  # noqa: BLE001 - an exception type that wants other arguments
        raised = _exception_type(_describe(error)[2] if error is not None else failed[0][1][2])(message)
    # A bad setting, a missing module or file: the message says it all, perseus's own frames would only hide
    # it. Anything else keeps the failing rank's traceback for the report.
    expected = isinstance(error, (ValueError, ImportError, OSError, NotImplementedError))
    raise raised from (None if expected else error)


def abort_job(comm, what: str, exc: BaseException) -> None:
    """End the whole MPI job after this rank failed inside a collective phase of start-up; never returns.

    The other ranks may be waiting inside an MPI call of the same phase, which nothing but an abort ends.
    Writes the reason and this rank's traceback to stderr first.
    """
    try:
        rank = load_mpi().COMM_WORLD.Get_rank()
    except Exception:  # noqa: BLE001 - MPI itself may be what failed; the message then says rank '?'
        rank = "?"
    sys.stderr.write(f"perseus: init() failed on rank {rank} while {what}: {type(exc).__name__}: {exc}\n")
    traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    sys.stderr.write("perseus: the other ranks wait inside a collective call of init() and cannot be told "
                     "otherwise; aborting the MPI job so that none of them hangs.\n")
    sys.stderr.flush()
    comm.Abort(1)


def affinity_cores(text: str) -> list[int]:
    """The core ids of PERSEUS_THREAD_AFFINITY (comma-separated, one per local rank); [] when empty.

    Raises:
        ValueError: an entry is not a core id of this machine (an integer in 0..cores-1).
    """
    cores = []
    available = os.cpu_count() or 1
    for item in (t.strip() for t in text.split(",") if t.strip()):
        try:
            core = int(item)
        except ValueError:
            core = -1
        if not 0 <= core < available:
            raise ValueError(f"PERSEUS_THREAD_AFFINITY/HOROVOD_THREAD_AFFINITY={text!r}: {item!r} is not a core id "
                             f"of this machine (0..{available - 1}); give one core id per local rank, e.g. 0,1")
        cores.append(core)
    return cores


def topology(MPI, base) -> tuple:
    """``(rank, size, local_rank, local_size, cross_rank, cross_size, homogeneous, host_key)`` of this rank
    in ``base``. Collective over ``base``."""
    rank, size = base.Get_rank(), base.Get_size()
    local = base.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_size = local.Get_rank(), local.Get_size()
    cross = base.Split(local_rank, rank)
    cross_rank, cross_size = cross.Get_rank(), cross.Get_size()
    homogeneous = len(set(base.allgather(local_size))) == 1
    host_key = local.allreduce(rank, op=MPI.MIN)  # the world rank of this host's first rank
    local.Free()
    cross.Free()
    return (rank, size, local_rank, local_size, cross_rank, cross_size, homogeneous, host_key)


def choose_by_topology(settings, topology) -> None:
    """Set what ``settings`` leave to the job's topology (a :class:`perseus.runtime.state.Topology`): the
    channel count when num_channels is 0 (:func:`perseus.engine.settings.topology_channels`). Rank 0 logs the
    count in use at info level.

    The job spans several hosts when this rank's host holds fewer than all ranks. Every rank reaches the same
    answer: a host with fewer than all ranks means there is another host, so then no host holds them all.
    (``cross_size`` would not do: with different numbers of ranks per host it differs between ranks.)

    Raises:
        ValueError: num_channels is negative.
    """
    multi_host = topology.local_size < topology.size
    given = int(settings.num_channels)
    settings.num_channels = topology_channels(given, multi_host)
    if topology.rank == 0:
        why = ("as set (PERSEUS_NUM_CHANNELS)" if given else
               f"chosen by topology: the job spans {topology.cross_size} hosts" if multi_host else
               "chosen by topology: one host")
        logging.getLogger("perseus").info("%d channel%s per process set, %s", settings.num_channels,
                                          "s" if settings.num_channels != 1 else "", why)


_LEVELS = {"trace": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR, "fatal": logging.CRITICAL}


def configure_logging(settings, rank: int) -> None:
    """Send perseus's log to stderr at the configured level, prefixed with the rank (unless the user set up
    handlers for the 'perseus' logger already)."""
    logger = logging.getLogger("perseus")
    logger.setLevel(_LEVELS[settings.log_level.lower()])
    if logger.handlers:
        return
    stamp = "" if settings.log_hide_time else "%(asctime)s "
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"{stamp}[perseus rank {rank}] %(levelname)s: %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False


def warn_ignored_settings(settings) -> None:
    """Say once per init() which Horovod settings perseus accepts but does not act on."""
    log = logging.getLogger("perseus")
    if settings.mpi_threads_disable:
        log.warning("HOROVOD_MPI_THREADS_DISABLE/PERSEUS_MPI_THREADS_DISABLE is ignored: perseus's engine and "
                    "channel threads need MPI_THREAD_MULTIPLE, so MPI is always initialised with it.")


_hook_installed = False


def install_abort_hook(MPI) -> None:
    """Make an uncaught exception on any rank abort the whole job instead of leaving the others hanging."""
    global _hook_installed
    if _hook_installed:
        return
    _hook_installed = True
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        if issubclass(exc_type, (KeyboardInterrupt, SystemExit)):
            return
        try:
            sys.stderr.write(f"perseus: rank {MPI.COMM_WORLD.Get_rank()} raised {exc_type.__name__}; aborting "
                             "the job so the other ranks do not hang (PERSEUS_ABORT_ON_EXCEPTION=0 disables).\n")
            sys.stderr.flush()
        finally:
            MPI.COMM_WORLD.Abort(1)

    sys.excepthook = hook
