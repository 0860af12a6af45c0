"""What switches at training steps every rank agrees on, and the tuner's hold on it: Espresso's policy
(``'espresso'``, ``'dense'`` or
``'all-compressed'``) and the algorithm of sparse all-reduces (``'auto'``, ``'zen'``, ...).

An engine parameter switches through a TUNE request, which the engine negotiates: every rank switches at the
same point of the negotiated sequence. A compressor's policy cannot switch that way: it decides which
collectives carry a gradient (a dense all-reduce, a top-k all-gather), so every rank must switch at the same
*training step*, or one rank waits in a collective the others never start. The tuner thread of each rank
learns a new setting at its own moment (and can lag behind its training thread by any amount), so neither
"switch when the tuner hears of it" nor "switch at some step counted from now" is safe. Instead:

* The tuner of every rank numbers the settings it applies (1, 2, ...; the same numbers on every rank, since
  every rank applies the same broadcast settings in the same order) and posts each one, before applying it,
  as a *proposal*: the policy (an index into COMPRESSION_POLICIES, or -1: leave the policy alone) and
  whether it is the final setting (``done``).
* While a compressor is registered and no final proposal has been applied, the compressor's training
  thread, at each of its step boundaries (its first call of a step, before it submits anything of the
  step), runs one small synchronous all-reduce (MAX, over its process set, named
  ``perseus.autotune.policy.<step>``) of the highest proposal number its rank's tuner has posted and of
  whether that tuner has ended without a final proposal.
* A maximum above the number applied so far means some rank's tuner has received that setting, so its
  broadcast has completed, so every rank's tuner receives it: the thread waits for its own tuner to post it
  (at most :data:`WAIT_S` seconds, then :class:`~perseus.base.exceptions.PerseusInternalError`) and applies
  its policy from this step on. Every rank computes the same maximum at the same boundary, so every rank
  applies the same policy at the same step.
* Once a final proposal is applied, or some rank's tuner has ended without one, the per-step all-reduce stops,
  at the same boundary on every rank (the same maxima again). The compressor is then left alone.

One compressor per job takes part: the first to register with the tuner (:func:`attach`); others are never
touched by the tuner. The sparse all-reduce path follows a second link of its own (named ``sparse``, its
per-step all-reduce ``perseus.autotune.sparse.<step>``), by the same protocol: "compressor" below reads
"participant".
"""

from __future__ import annotations

import threading
import weakref
from typing import Optional

import numpy as np

from perseus.base.exceptions import PerseusInternalError
from perseus.base.reduce_ops import ReduceOp
from perseus.runtime.state import runtime
from perseus.engine.messages import DType, OpType, Request, Timing

__all__ = ["PolicyLink", "Follower", "Following", "attach", "WAIT_S"]

#: how long a compressor waits for its own tuner to receive a proposal another rank has received
WAIT_S = 30.0

_ALLREDUCE, _INT64, _MAX = OpType.ALLREDUCE, DType.INT64, ReduceOp.MAX


class PolicyLink:
    """The tuner's side (one per :class:`~perseus.autotune.tuner.Tuner`): the registered compressor and the
    proposals this rank's tuner has posted. Thread-safe."""

    def __init__(self, name: str = "policy"):
        self.name = name      # names the per-step all-reduce: perseus.autotune.<name>.<step>
        self._cond = threading.Condition()
        self._proposals: dict[int, tuple[int, bool]] = {}
        self._compressor = None  # weakref to the one compressor taking part
        self.follower: Optional[Follower] = None
        self.posted = 0       # the highest proposal number posted (0: none)
        self.done = False     # the final proposal has been posted
        self.ended = False    # the tuner thread ended without posting a final proposal

    def register(self, compressor) -> Optional["Follower"]:
        """The follower for ``compressor`` if it is (or now becomes) the one compressor taking part, else None."""
        with self._cond:
            if self._compressor is None:
                self._compressor = weakref.ref(compressor)
                self.follower = Follower(self)
                return self.follower
            return self.follower if self._compressor() is compressor else None

    def registered(self):
        """The compressor taking part, or None (none registered, or it is gone)."""
        with self._cond:
            return None if self._compressor is None else self._compressor()

    def post(self, policy: int, done: bool = False) -> None:
        """The tuner: the next setting it applies carries ``policy`` (-1: leave it alone); ``done``: the final
        one. Nothing is posted after the final proposal."""
        with self._cond:
            if self.done:
                return
            self.posted += 1
            self._proposals[self.posted] = (int(policy), bool(done))
            self.done = bool(done)
            self._cond.notify_all()

    def end(self) -> None:
        """The tuner thread has ended; if it never posted a final proposal, the compressors stop following."""
        with self._cond:
            if not self.done:
                self.ended = True
            self._cond.notify_all()

    def state(self) -> tuple[int, bool]:
        with self._cond:
            return self.posted, self.ended

    def proposal(self, number: int, timeout: float = WAIT_S) -> tuple[int, bool]:
        """``(policy, done)`` of proposal ``number``, waiting up to ``timeout`` seconds for it to be posted."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.posted >= number, timeout):
                raise PerseusInternalError(
                    f"perseus autotune: another rank applies setting {number} of the tuner at this step, but this "
                    f"rank's tuner has received only {self.posted} after {timeout:g} s; the compressor policy cannot "
                    "switch at the same step on every rank (is this rank's tuner thread stuck?)")
            return self._proposals[number]


class Follower:
    """The compressor's side: called on the compressor's training thread at every reduction (see the module
    docstring). ``policies`` in effect are reported as indexes; the compressor maps them to its names."""

    def __init__(self, link: PolicyLink):
        self.link = link
        self.applied = 0        # the highest proposal number applied
        self.finished = False   # no more per-step all-reduces
        self.steps = 0          # step boundaries passed
        self.waits = 0          # proposals another rank had received first (this rank waited for its tuner)
        self._keys: set = set()

    def at_call(self, key: str, process_set) -> Optional[int]:
        """Note a reduction of ``key``; at a step boundary (the first call, and every call whose key came
        already in the current step) run the per-step all-reduce. Returns the policy index to use from this
        step on, or None to keep the one in force. Collective at step boundaries while not finished."""
        if self.finished:
            return None
        if self._keys and key not in self._keys:
            self._keys.add(key)
            return None
        self._keys = {key}
        step = self.steps
        self.steps += 1
        posted, ended = self.link.state()
        top, any_ended = _max(f"perseus.autotune.{self.link.name}.{step}", process_set, posted, ended)
        policy = None
        if top > self.applied:
            if top > posted:
                self.waits += 1
            code, done = self.link.proposal(top, WAIT_S)
            self.applied = top
            policy = code if code >= 0 else None
            if done:
                self.finished = True
        if any_ended:
            self.finished = True
        return policy


def _max(name: str, process_set, posted: int, ended: bool) -> tuple[int, bool]:
    """The per-step all-reduce (MAX over ``process_set``) of ``(posted, ended)``."""
    st = runtime()
    ps_id, size, _ = st.process_set_info(process_set)
    buf = np.array([posted, int(ended)], np.int64)
    if size > 1:
        engine = st.engine
        # Timing.NONE: the engine counts it in no training step (nor in the step's digest).
        item = Request(name=name, dtype=_INT64, shape=buf.shape, input=buf, output=buf, reduce_op=_MAX,
                       timing=Timing.NONE)
        engine.wait(engine.submit(ps_id, _ALLREDUCE, [item], None, buf))
    return int(buf[0]), bool(buf[1])


class Following:
    """A participant's hold on the job's tuner through link ``link`` ('sparse', 'dear'): registers with the
    tuner on first use (anew when a later ``init()`` made a new tuner) and, at each call, runs the follower's
    step-boundary agreement. Without a tuner, or when another participant holds the link, nothing happens."""

    def __init__(self, link: str):
        self.link = link
        self._tuner = None  # weakref to the tuner registered with
        self.follower: Optional[Follower] = None

    def at_call(self, participant, key: str, process_set) -> Optional[int]:
        """The setting index to use from this call on, or None to keep the one in force. Collective while
        following (see :meth:`Follower.at_call`)."""
        tuner = runtime().service("tuner")
        if tuner is None:
            return None
        if self._tuner is None or self._tuner() is not tuner:
            self._tuner = weakref.ref(tuner)
            self.follower = getattr(tuner, self.link).register(participant)
        if self.follower is None:
            return None
        return self.follower.at_call(key, process_set)


def attach(compressor, link: str = "policy") -> tuple[Optional[Follower], bool]:
    """Register ``compressor`` with this job's tuner: ``(follower or None, whether a tuner was there to ask)``.
    Without a tuner (no autotuning, or perseus not initialised yet) the caller may ask again later.
    ``link``: ``'policy'`` (a compressor) or ``'sparse'`` (the sparse all-reduce path)."""
    tuner = runtime().service("tuner")
    if tuner is None:
        return None, False
    return getattr(tuner, link).register(compressor), True
