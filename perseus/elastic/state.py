"""Elastic training state, framework-neutral (Horovod's ``horovod.common.elastic``).

A training function decorated with ``run`` (``perseus.torch.elastic.run``) receives a :class:`State`. The
function calls ``state.commit()`` every so often; ``commit()`` snapshots the state in host memory and checks
for host changes. When a collective fails, the retry loop in :func:`run_fn` puts the last commit back
(``state.restore()``), restarts perseus (``shutdown(); init()``), makes every rank agree on rank 0's state
(``state.sync()``) and calls the function again.

What this gives a *static* job (started by ``mpirun``/``perseusrun``, no host discovery):

* A collective that failed on **every** rank -- a shape/dtype/op mismatch across ranks, a stall that hit the
  stall shutdown time, a transport error every rank reported -- raises ``HorovodInternalError`` everywhere;
  each rank restores its last commit, perseus restarts, state is synced from rank 0 and training goes on.
* A rank that **died** cannot be replaced. Without the elastic launcher nothing starts a new process or
  re-forms the job with fewer ranks, so ``init()`` after the reset would need the dead rank. (Under Open MPI the job is
  normally aborted as a whole when a rank dies.) An error seen by only some ranks is not recoverable either:
  the others are still waiting in a collective.
* The number of resets is capped (:data:`DEFAULT_RESET_LIMIT`, or ``PERSEUS_ELASTIC_RESET_LIMIT``), so an error
  that comes back at every attempt ends the job with a clear message instead of looping forever.

Under the elastic launcher (``perseusrun --host-discovery-script``) host changes reach the ranks through
:data:`~perseus.elastic.notifications.notification_manager`, whose source is the rank's session with the
launcher (:mod:`perseus.elastic.worker`); in a static job nothing is attached to it, so no notification ever
arrives.
"""

from __future__ import annotations

import copy
import functools
import logging
import queue
from typing import Optional

from perseus.base.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from perseus.base.knobs import knob, read_knob
from perseus.runtime.state import runtime
from perseus.elastic import worker
from perseus.elastic.notifications import (HostUpdateResult, WorkerNotificationManager, has_notification_source,
                                           notification_manager, set_notification_source)

__all__ = [
    "HostUpdateResult",
    "WorkerNotificationManager",
    "notification_manager",
    "set_notification_source",
    "State",
    "ObjectState",
    "run_fn",
    "reset_limit",
    "DEFAULT_RESET_LIMIT",
    "RESET_LIMIT_ENV",
]

log = logging.getLogger("perseus.elastic")

#: Resets allowed per ``run`` call in a job not started by an elastic launcher.
DEFAULT_RESET_LIMIT = knob("elastic_reset_limit").default
#: Environment variable overriding the reset limit (an integer >= 0; ``none``/``unlimited`` for no limit).
RESET_LIMIT_ENV = knob("elastic_reset_limit").env[0]




# ---------------------------------------------------------------------------------------------------------
# State
# ---------------------------------------------------------------------------------------------------------

def _snapshot_value(value):
    """A deep copy, so later in-place changes do not reach the snapshot; the object itself if it cannot be
    copied (a lock, a generator, an open file)."""
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - any failure to copy means: keep the reference, as Horovod does
        return value


class State:
    """State kept identical across workers and rolled back to the last commit after a failure.

    Args:
        bcast_object: ``bcast_object(obj)`` returns rank 0's ``obj`` on every rank (collective).
        get_rank: returns this worker's rank.

    Subclasses implement :meth:`save`, :meth:`restore` and :meth:`sync`, and may override :meth:`reset`.
    """

    def __init__(self, bcast_object, get_rank):
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._host_messages = queue.Queue()
        self._last_updated_timestamp = 0
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks) -> None:
        """Add functions to call, with no arguments, after every reset (for example to rescale the learning
        rate to the new ``size()``)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Called by the ``run`` loop after perseus restarted: drop stale notifications, :meth:`reset`, then
        the reset callbacks in registration order."""
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp, update_res) -> None:
        """Queue a host-change notification; it takes effect at the next :meth:`check_host_updates`."""
        self._host_messages.put((timestamp, update_res))

    def commit(self) -> None:
        """Snapshot the state in host memory (:meth:`save`), then :meth:`check_host_updates`.

        Collective: every rank commits at the same point. A commit copies the whole state, so committing every
        few batches rather than every batch trades a little recomputation after a failure for speed.
        """
        self.save()
        session = getattr(self, "_elastic_session", None)
        if session is not None:
            session.commit(self)
        self.check_host_updates()

    def _after_snapshot(self, fn) -> None:
        """Run ``fn()`` once the snapshot :meth:`save` just took is complete: here at once; states that copy
        in the background (``TorchState``) run it after the copy, on their copying thread."""
        fn()

    def _wait_snapshot(self) -> None:
        """Wait until the last snapshot (and what :meth:`_after_snapshot` queued) is complete."""

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` on every rank if rank 0 has been told that hosts changed.

        Collective and uniform: every rank takes part in one small broadcast of rank 0's view, so all ranks
        raise, or none does, at the same call. In a static job no notification arrives, so this never raises
        unless :meth:`on_hosts_updated` is called directly.
        """
        prev = last = self._last_updated_timestamp
        update = HostUpdateResult.no_update
        while True:
            try:
                timestamp, res = self._host_messages.get_nowait()
            except queue.Empty:
                break
            if timestamp > last:
                last = timestamp
                update |= HostUpdateResult(int(res))
        prev, last, update = self._bcast_host_update((prev, last, int(update)))
        self._last_updated_timestamp = last
        if last > prev:
            # Only removed hosts: the survivors' state is already consistent, so the next attempt need not sync.
            raise HostsUpdatedInterrupt(HostUpdateResult(int(update)) == HostUpdateResult.removed)

    def _bcast_host_update(self, values):
        """Rank 0's ``(previous timestamp, latest timestamp, update flags)``; frameworks may override with a
        cheaper broadcast."""
        return tuple(self._bcast_object(tuple(values)))

    def save(self) -> None:
        """Snapshot the state in host memory."""
        raise NotImplementedError()

    def restore(self) -> None:
        """Put the last snapshot back, undoing every change made since."""
        raise NotImplementedError()

    def sync(self) -> None:
        """Make every rank's state equal to rank 0's (collective)."""
        raise NotImplementedError()

    def reset(self) -> None:
        """Adjust to the restarted job (new ``rank()``/``size()``), before :meth:`sync`. Default: nothing."""

    def snapshot_payload(self):
        """The last snapshot as a picklable object (NumPy arrays for tensors), for the elastic launcher's
        checkpoint keepers. Must not change when the live state changes later.

        Raises:
            NotImplementedError: this kind of state cannot be kept by the keepers.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot be checkpointed to the elastic launcher's "
                                  f"keepers; use TorchState, TensorFlowKerasState, TensorFlowState or ObjectState")

    def load_snapshot_payload(self, payload) -> None:
        """Make ``payload`` (from :meth:`snapshot_payload`, perhaps of another process) the last snapshot;
        :meth:`restore` then puts it in place."""
        raise NotImplementedError(f"{type(self).__name__} cannot be restored from the elastic launcher's keepers")


# Names an ObjectState attribute may not take: they would hide the State's own machinery.
_INTERNAL_NAMES = frozenset({"_bcast_object", "_rank", "_host_messages", "_last_updated_timestamp",
                             "_reset_callbacks", "_saved_state", "_handlers",
                             "_elastic_session"})


def _check_attribute_names(cls, names) -> None:
    for name in names:
        if name in _INTERNAL_NAMES or name.startswith("__") or hasattr(cls, name):
            raise ValueError(f"{cls.__name__}: cannot track an attribute named {name!r}: it would hide "
                             f"{cls.__name__}'s own {name!r}; pick another name")


class ObjectState(State):
    """State made of plain Python objects, one per keyword argument, exposed as attributes.

    ``save()`` deep-copies the current attribute values; ``restore()`` sets (copies of) the snapshot back;
    ``sync()`` broadcasts rank 0's *snapshot* (not uncommitted changes) and sets it on every rank.

    Args:
        bcast_object: broadcast function used by ``sync()`` (``perseus.torch.broadcast_object``).
        get_rank: rank function (``perseus.torch.rank``).
        kwargs: the tracked values; ``state.<name>`` reads and writes them.
    """

    def __init__(self, bcast_object, get_rank, **kwargs):
        _check_attribute_names(type(self), kwargs)
        self._bcast_object = bcast_object
        self._saved_state = {name: _snapshot_value(value) for name, value in kwargs.items()}
        for name, value in kwargs.items():
            setattr(self, name, value)
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {name: _snapshot_value(getattr(self, name)) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def snapshot_payload(self):
        return {"objects": self._saved_state}

    def load_snapshot_payload(self, payload) -> None:
        self._saved_state = dict(payload["objects"])

    def _set_attrs(self) -> None:
        # Copies: changing an attribute in place must not change the snapshot a later restore() uses.
        for name, value in self._saved_state.items():
            setattr(self, name, _snapshot_value(value))


# ---------------------------------------------------------------------------------------------------------
# The retry loop
# ---------------------------------------------------------------------------------------------------------

def reset_limit() -> Optional[int]:
    """How many resets one ``run`` call may do before giving up; ``None`` for no limit.

    ``PERSEUS_ELASTIC_RESET_LIMIT`` if set. Otherwise :data:`DEFAULT_RESET_LIMIT` in a static job; with an elastic
    launcher attached, no limit here (the launcher's own ``--reset-limit`` governs).

    Raises:
        ValueError: the variable is set to something other than an integer >= 0 or ``none``.
    """
    value, explicit = read_knob("elastic_reset_limit")
    if not explicit:
        return None if notification_manager.attached else DEFAULT_RESET_LIMIT
    return value


def _give_up(error: BaseException, resets: int, limit: int) -> BaseException:
    """``error``'s type, with a message saying why the loop stopped."""
    value, explicit = read_knob("elastic_reset_limit")
    if explicit:
        source = f"{RESET_LIMIT_ENV}={'none' if value is None else value}"
    else:
        source = f"the default for a job without an elastic launcher; set {RESET_LIMIT_ENV} to change it"
    detail = str(error) or "(no message)"
    message = f"perseus elastic: giving up after {resets} reset(s) (limit {limit}: {source}). Last error: " \
              f"{type(error).__name__}: {detail}."
    if not notification_manager.attached:
        message += (" This job was not started by an elastic launcher, so its ranks cannot change: a reset only"
                    " helps when a collective failed on every rank for a passing reason. A rank that died cannot"
                    " be replaced, and an error that recurs at every attempt will not go away.")
        try:
            if read_knob("elastic")[0]:
                message += (" (HOROVOD_ELASTIC/PERSEUS_ELASTIC is set, but no elastic launcher is attached to"
                            " this process.)")
        except ValueError:  # an unreadable value: the note is optional
            pass
    if isinstance(error, HostsUpdatedInterrupt):
        new = type(error)(error.skip_sync)
    else:
        try:
            new = type(error)(message)
        except Exception:  # noqa: BLE001 - an exception type with another constructor
            new = HorovodInternalError(message)
    new.args = (message,)
    return new


def run_fn(func, reset, init_on=None):
    """Wrap ``func(state, *args, **kwargs)`` in the elastic retry loop; ``reset()`` restarts the framework.

    Each attempt syncs the state from rank 0 (unless the previous attempt ended in a hosts-removed interrupt),
    then calls ``func``. On ``HorovodInternalError`` the state is restored to its last commit; on
    ``HostsUpdatedInterrupt`` it is kept. Then ``reset()`` and ``state.on_reset()`` run and the loop starts
    again. Any other exception propagates at once. After :func:`reset_limit` resets the next elastic error
    propagates, re-raised with a message explaining why.

    Under the elastic launcher (``perseusrun --host-discovery-script``) the loop is :func:`_run_relaunched`
    instead; ``init_on(comm)`` restarts the framework on a given communicator (the survivors' after a failure).
    """

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        session = _launcher_session()
        if session is not None:
            return _run_relaunched(session, func, state, args, kwargs, init_on)
        notification_manager.init()
        limit = reset_limit()
        notification_manager.register_listener(state)
        resets = 0
        skip_sync = False
        try:
            while True:
                try:
                    if not skip_sync:
                        state.sync()
                    return func(state, *args, **kwargs)
                except HorovodInternalError as e:
                    error = e
                    state.restore()
                    skip_sync = False
                except HostsUpdatedInterrupt as e:
                    error = e
                    skip_sync = e.skip_sync
                if limit is not None and resets >= limit:
                    raise _give_up(error, resets, limit) from error
                resets += 1
                what = "hosts changed" if isinstance(error, HostsUpdatedInterrupt) else \
                    f"{type(error).__name__}: {error}; restored the last commit"
                log.warning("elastic reset %d%s: %s; restarting", resets,
                            f" of {limit}" if limit is not None else "", what)
                del error
                reset()
                state.on_reset()
        finally:
            notification_manager.remove_listener(state)

    return wrapper


# ---------------------------------------------------------------------------------------------------------
# Under the elastic launcher
# ---------------------------------------------------------------------------------------------------------

def _launcher_session():
    """The elastic launcher's session for this rank (perseus must be initialised), or None in a job
    without one."""
    if not worker.launcher_attached():
        return None
    if not runtime().is_initialized():
        raise ValueError("perseus elastic: call init() before the function decorated with elastic.run")
    if not has_notification_source():
        # The driver connection delivers host changes: mark the manager attached (reset_limit and the error
        # messages then speak of a launcher).
        set_notification_source(lambda manager: worker.session(runtime().rank(), runtime().size()))
    notification_manager.init()
    return worker.session(runtime().rank(), runtime().size())


def _run_relaunched(session, func, state, args, kwargs, init_on):
    """One generation of a job under the elastic launcher.

    A later generation first restores the newest commit from the keepers (every rank, collectively) and runs
    the reset callbacks (``size()`` may have changed); then the state is synced from rank 0 and ``func`` runs.
    Every ``commit()`` is also copied to the keepers.

    ``HorovodInternalError`` (a collective failed, perhaps because a rank died): every survivor restores its
    last commit from its own memory and, where MPI can (ULFM), the survivors re-form the job among themselves
    in process (``init_on(comm)`` restarts perseus on the shrunk communicator), run the reset callbacks, sync
    from the new rank 0 and call ``func`` again. Where it cannot, the rank flushes its last commit, tells the
    driver and exits; the driver starts a new generation, whose ranks restore from the keepers.
    ``HostsUpdatedInterrupt`` (hosts added or removed): every rank flushes, tells the driver and exits at the
    same commit; the driver starts the next generation on the new hosts. An exception from ``func`` itself is
    reported to the driver, which ends the job, and propagates.
    """
    state._elastic_session = session
    notification_manager.register_listener(state)
    try:
        if session.generation > 0:
            session.restore(state, state._bcast_object)
            state.on_reset()
        while True:
            try:
                state.sync()
                result = func(state, *args, **kwargs)
                break
            except HorovodInternalError as e:
                log.warning("perseus elastic: rank %d: %s: %s", session.rank, type(e).__name__, e)
                state.restore()
                if not (init_on is not None and session.in_process
                        and session.recover_in_process(runtime().world_comm(), init_on)):
                    session.leave_for_reset(e, graceful=False)
                state.on_reset()
            except HostsUpdatedInterrupt as e:
                session.leave_for_reset(e, graceful=True)
    except BaseException as e:
        if not isinstance(e, (KeyboardInterrupt, SystemExit)):
            session.report_error(e)
        raise
    finally:
        notification_manager.remove_listener(state)
    session.report_done()
    return result
