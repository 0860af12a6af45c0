"""``init()`` and ``shutdown()``: the runtime started together with the services built on it.

The runtime (:mod:`perseus.runtime.state`) knows nothing of the tuner or of elastic jobs; this module is where
they are wired in. ``init()`` starts the runtime with the run-time tuner as a service (it runs only under
``HOROVOD_AUTOTUNE``/``PERSEUS_AUTOTUNE`` in a job of more than one rank) and, in a rank started by the elastic
launcher, opens the rank's session with the launcher's driver. Logging and the abort hook are set up by the
runtime's start-up phases (:mod:`perseus.runtime.startup`).
"""

from __future__ import annotations

from typing import Sequence

from perseus.autotune.service import TunerService
from perseus.runtime.process_sets import ProcessSet
from perseus.runtime.state import runtime
from perseus.elastic import worker

__all__ = ["init", "shutdown", "add_process_set", "remove_process_set"]

_SERVICES = (TunerService(),)


def init(comm=None, process_sets=None):
    """Start perseus on this process. On a running perseus (e.g. started by another framework module) it
    starts nothing; given ``process_sets`` it then assigns them the ids of the registered sets with their
    ranks. See :meth:`perseus.runtime.state.Runtime.start` for the arguments.

    Collective: every rank of ``comm`` (default: every rank of the job) must call it. Start-up is all or
    nothing: a failure on one rank raises on every rank, or, inside MPI's collective calls, aborts the job.

    Raises:
        ValueError: bad arguments, duplicate process sets, or MPI cannot run perseus (the message says what
            to do). Any other start-up failure on some rank is raised on every rank, naming the rank.
    """
    rt = runtime()
    if rt.start(comm, process_sets, _SERVICES) and worker.launcher_attached():
        worker.session(rt.rank(), rt.size())  # report to the elastic launcher's driver from the start


def shutdown():
    """Stop perseus on this rank: the services stop, pending requests fail, and per-job state (handles, the
    numbering of unnamed requests) is forgotten, so that a later ``init()`` starts afresh. Safe to call more
    than once."""
    runtime().shutdown()


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a new process set after init; see :meth:`perseus.runtime.state.Runtime.add_process_set`.
    Collective: every rank calls it with the same ranks."""
    return runtime().add_process_set(process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Deregister a process set; see :meth:`perseus.runtime.state.Runtime.remove_process_set`."""
    return runtime().remove_process_set(process_set)
