"""Espresso: decide per gradient whether to compress it, and how, by simulating the iteration.

Compressing a gradient saves link time but costs encode time on the thread that runs backward and decode
time afterwards; whether it pays depends on what else is happening. A gradient whose collective finishes
before the next gradient is ready (its collective is followed by an idle gap of the link, a *bubble*)
gains nothing from compression; a large gradient at the end of backward on a slow link gains a lot; a
tiny one pays a fixed encode cost for a few bytes. Espresso models the iteration and picks, gradient by
gradient, the option with the least modelled iteration time.

The model (a timeline simulator of backward, encode, the link and decode), the link and codec costs and
the decision (the thesis's Algorithm 4.1) are in :mod:`perseus.compression.espresso_model`.

:class:`Espresso` wraps it as a compressor (``Compression.espresso(density=0.01)``): it profiles the first
steps with dense float32 all-reduces, decides on the first rank of the process set, broadcasts the choice
per key, and from then on reduces every gradient through its chosen option.

Every rank of the process set must reduce the same keys in the same order and switch policies between the
same steps: deciding runs collectives (``espresso.probe.*``, ``espresso.plan.*``) at the same call on every
rank. :class:`Espresso` raises ValueError for bad arguments, an unknown policy or an unnamed gradient.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional, Sequence

import numpy as np

from perseus.runtime.step_policy import attach as _attach_autotune
from perseus.runtime.process_sets import ProcessSet, global_process_set
from perseus.base.reduce_ops import ReduceOp
from perseus.compression.base import Pending, Reducer
from perseus.compression.profiling import (StepProfiler, _set_info, broadcast_from_first, fit_affine,
                                         probe_collective)
from perseus.compression.espresso_model import (allgather_time, allreduce_time, decide,  # noqa: F401
                                                measure_codec, simulate_timeline)
from perseus.compression.dense import Dense
from perseus.compression.topk import TopK

__all__ = ["Espresso", "allreduce_time", "allgather_time", "simulate_timeline", "decide", "measure_codec",
           "POLICIES"]

log = logging.getLogger("perseus")

#: the policies :meth:`Espresso.set_policy` accepts
POLICIES = ("espresso", "dense", "all-compressed")
#: a gradient is compressed only when that shortens the modelled iteration by more than this fraction of the
#: dense iteration's modelled time: encode and decode times are measured on a busy machine, and a choice
#: within their noise would flip between runs (and cost real time on a fast link)
MIN_GAIN = 0.01
#: ... and by more than this many seconds: a lossy choice must buy at least a tenth of a millisecond per step
#: (smaller modelled gains are within the noise of codec timings taken on a busy machine)
MIN_GAIN_S = 1e-4


def _option_name(r: Reducer) -> str:
    if isinstance(r, Dense):
        return r.kind
    if isinstance(r, TopK):
        return f"topk({r.density:g})"
    return repr(r)


# -- the wrapper ---------------------------------------------------------------------------------------------------
class Espresso(Reducer):
    """Choose per gradient between dense float32, float16 and compressed reductions by simulating the
    iteration (``Compression.espresso(density=0.01)``).

    Life cycle, per instance (give each optimizer its own):

    1. *Warm-up and profiling*: the first ``warmup_steps + profile_steps`` steps reduce every gradient dense
       (float32 all-reduce) and record each key's size, arrival order and time, and the seconds the caller
       spent in the reduction call; the gaps between arrivals, less those seconds, estimate each gradient's
       backward time (warm-up steps are not used). A step ends when a key comes again.
    2. *Deciding*, at the first call of the next step, collective over the process set: unless both
       ``bandwidth_mbit`` and ``latency_us`` are given, every rank times all-reduces of 4 KB, 256 KB and 4 MB
       (best of 3) and the first rank fits the ring all-reduce model to get the link's alpha and beta (a
       given value overrides the fitted one). The first rank measures every option's encode, decode and
       payload (:func:`measure_codec`), runs :func:`decide` and broadcasts the choice per key, which every
       rank then uses.
    3. Every gradient goes through its option's compressor (keys not seen while profiling: dense).

    The rank that decides logs a one-line summary; :meth:`report` and :meth:`format_report` give the choice
    per gradient with its predicted saving.

    Policies (:meth:`set_policy`, also a dimension an autotuner can search): ``'espresso'`` (the decision,
    the default), ``'dense'`` (every gradient dense float32), ``'all-compressed'`` (every gradient through
    the compressed option that sends the fewest bytes for the largest gradient).

    Under the run-time autotuner (HOROVOD_AUTOTUNE), the first Espresso created after ``init()`` (or, if
    created before, the first to reduce) registers with the tuner, which may search its policy once it has
    decided; while the tuner may still change it, every step begins with one small all-reduce that makes
    every rank switch at the same step (:mod:`perseus.runtime.step_policy`, docs/autotune.md). Other Espresso
    instances of the job are left alone. Calling :meth:`set_policy` before the search starts keeps that
    policy (with the default PERSEUS_AUTOTUNE_FIXED=explicit).

    Args:
        candidates: the options besides dense float32 (always option 0): a list of ``'fp16'``, ``'topk'`` (at
            ``density``) or communicating compressors (``Compression.topk(0.001)``, ...). Default: fp16 and
            top-k. A compressor that does not encode in one step (PowerSGD) cannot be modelled and is left
            out, with a warning.
        density: the top-k density of the default ``'topk'`` option.
        bandwidth_mbit: link bandwidth per rank in Mbit/s, instead of the probe.
        latency_us: link latency in microseconds, instead of the probe.
        profile_steps: steps timed before deciding (after the warm-up steps).
        warmup_steps: steps passed through before timing starts.

    Raises:
        ValueError: an unknown candidate name, a bad density, profile_steps < 1, warmup_steps < 0.
    """

    kind = "espresso"
    default_error_feedback = False

    def __init__(self, candidates=None, density: float = 0.01, bandwidth_mbit: Optional[float] = None,
                 latency_us: Optional[float] = None, profile_steps: int = 1, warmup_steps: int = 1):
        if int(profile_steps) < 1 or int(warmup_steps) < 0:
            raise ValueError("perseus: Compression.espresso: profile_steps must be >= 1 and warmup_steps >= 0")
        opts: list = [Dense("float32")]
        for c in (["fp16", "topk"] if candidates is None else list(candidates)):
            if c == "fp16":
                opts.append(Dense("float16"))
            elif c == "topk":
                opts.append(TopK(density))
            elif c == "dense":
                continue
            elif isinstance(c, Reducer) and not isinstance(c, (Espresso,)):
                if type(c)._encode is Reducer._encode:
                    log.warning("espresso: %r runs several collectives per gradient and cannot be modelled; "
                                "it is not a candidate", c)
                    continue
                opts.append(c)
            else:
                raise ValueError(f"perseus: Compression.espresso: unknown candidate {c!r}; use 'fp16', 'topk' or "
                                 "a communicating compressor")
        self.candidates = opts
        self.names = [_option_name(r) for r in opts]
        super().__init__(error_feedback=False)
        self.density = float(density)
        self.bandwidth_mbit = None if bandwidth_mbit is None else float(bandwidth_mbit)
        self.latency_us = None if latency_us is None else float(latency_us)
        self.profile_steps = int(profile_steps)
        self.warmup_steps = int(warmup_steps)
        self.policy = "espresso"
        self._pending_policy: Optional[str] = None
        self._rlock = threading.RLock()
        self._init_run_state()
        #: set_policy() was called (the autotuner then keeps the policy, as it keeps explicit settings)
        self.policy_explicit = False
        # The autotuner's follower when this instance takes part (perseus.runtime.step_policy); asked again at the
        # first reduction when no tuner ran at construction (created before init()).
        self._autotune, self._autotune_asked = _attach_autotune(self)

    def _init_run_state(self):
        self.profiler = StepProfiler()
        self._choice: Optional[dict] = None    # key -> option index, once decided
        self._info: dict = {}
        self._seen: set = set()

    @property
    def payload_bytes(self):
        return sum(r.payload_bytes for r in getattr(self, "candidates", ()))

    @payload_bytes.setter
    def payload_bytes(self, value):
        pass

    @property
    def dense_bytes(self):
        return sum(r.dense_bytes for r in getattr(self, "candidates", ()))

    @dense_bytes.setter
    def dense_bytes(self, value):
        pass

    def _describe(self) -> str:
        return f"candidates={self.names}, policy={self.policy!r}"

    # -- state -----------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the decision, the profile and every residual (the next steps profile again)."""
        with self._rlock:
            for r in self.candidates:
                r.reset()
            self._init_run_state()
            # After a shutdown (elastic reset) the next job's tuner is asked again; the same tuner gives the
            # same follower back.
            self._autotune, self._autotune_asked = None, False

    def residual(self, key: str) -> Optional[np.ndarray]:
        """The residual of ``key`` in the compressor its current option uses (None for dense)."""
        return self.candidates[self.option_of(key)].residual(key)

    @property
    def decided(self) -> bool:
        return self._choice is not None

    def choices(self) -> Optional[dict]:
        """``{key: option name}`` of the decision (whatever the policy); None before it is made."""
        return None if self._choice is None else {k: self.names[o] for k, o in self._choice.items()}

    def option_of(self, key: str) -> int:
        """The option index ``key`` uses now, under the policy in force."""
        if self._choice is None or self.policy == "dense":
            return 0
        if self.policy == "all-compressed":
            return int(self._info.get("compressed_option", len(self.candidates) - 1))
        return self._choice.get(key, 0)

    def set_policy(self, name: str) -> None:
        """Use ``name`` (one of :data:`POLICIES`) from the next step on.

        The switch happens at the start of the next step (the first key that comes again), so call it on
        every rank between two steps (after ``step()``, before the next backward); every rank then switches
        at the same call. Switching away from a compressor leaves its residuals in it, until a policy sends
        those gradients through it again. Before the decision is made (profiling) every gradient is dense
        whatever the policy.

        Raises:
            ValueError: an unknown policy.
        """
        if name not in POLICIES:
            raise ValueError(f"perseus: Espresso.set_policy: one of {', '.join(POLICIES)}, not {name!r}")
        with self._rlock:
            self.policy_explicit = True
            if self._choice is None:
                self.policy = name
            else:
                self._pending_policy = name

    # -- deciding --------------------------------------------------------------------------------------
    def _link(self, p: int, probe) -> tuple:
        alpha = beta = None
        if probe is not None:
            nbytes, times = probe
            a, b = fit_affine(nbytes, times)
            alpha, beta = a / (2 * (p - 1)), b * p / (2 * (p - 1))
        if self.latency_us is not None:
            alpha = self.latency_us * 1e-6
        if self.bandwidth_mbit is not None:
            beta = 8.0 / (self.bandwidth_mbit * 1e6)
        return float(alpha or 0.0), float(beta or 0.0)

    def _decide(self, p: int, probe) -> dict:
        prof = self.profiler.summary(skip=self.warmup_steps)
        keys = prof["order"]
        elements = np.asarray(prof["elements"], np.int64)
        x = 4.0 * elements
        alpha, beta = self._link(p, probe)
        usable, fits = [], []
        for i, r in enumerate(self.candidates):
            f = measure_codec(r, p)
            if f is not None:
                usable.append(i)
                fits.append(f)
        enc = np.array([f["encode"][0] + f["encode"][1] * x for f in fits])
        dec = np.array([f["decode"][0] + f["decode"][1] * x for f in fits])
        pay = np.array([f["payload"][0] + f["payload"][1] * x for f in fits])
        com = np.array([allreduce_time(pay[j], p, alpha, beta) if f["collective"] == "allreduce"
                        else allgather_time(pay[j], p, alpha, beta) for j, f in enumerate(fits)])
        back = np.asarray(prof["backward"], np.float64)
        cols = np.arange(len(keys))

        def total(ch):
            return simulate_timeline(back, enc[ch, cols], com[ch, cols], dec[ch, cols]) if len(keys) else 0.0

        t_dense = total(np.zeros(len(keys), np.int64))
        local = (decide(elements, back, enc, com, dec, min_gain=max(MIN_GAIN * t_dense, MIN_GAIN_S)) if keys
                 else np.zeros(0, np.int64))
        t_plan = total(local)
        # the compressed option sending the fewest bytes for the largest gradient (for 'all-compressed')
        big = int(np.argmax(elements)) if len(keys) else 0
        comp = [j for j in range(1, len(usable))]
        best_comp = min(comp, key=lambda j: (pay[j, big] if len(keys) else 0.0, j)) if comp else 0
        t_comp = total(np.full(len(keys), best_comp, np.int64))
        rows = []
        for i, key in enumerate(keys):
            saving = 0.0
            if local[i] != 0:
                ch = local.copy()
                ch[i] = 0
                saving = total(ch) - t_plan
            rows.append({"name": key, "size": int(elements[i]), "bytes": int(x[i]),
                         "option": self.names[usable[local[i]]], "predicted_saving_s": float(saving)})
        return {"choice": {k: usable[int(local[i])] for i, k in enumerate(keys)}, "report": rows,
                "compressed_option": usable[best_comp], "link": (alpha, beta), "ranks": p,
                "predicted": t_plan, "predicted_dense": t_dense, "predicted_all_compressed": t_comp,
                "options": [self.names[i] for i in usable]}

    def _decide_now(self, process_set: ProcessSet) -> None:
        """Collective: probe the link, decide on the first rank, broadcast, adopt."""
        size, rank, _ = _set_info(process_set)
        probe = None
        if size > 1 and (self.bandwidth_mbit is None or self.latency_us is None):
            nbytes = (4096, 256 << 10, 4 << 20)
            probe = (list(nbytes), probe_collective("allreduce", process_set, nbytes,
                                                    tag="espresso.probe"))
        info = self._decide(size, probe) if rank == 0 else None
        info = broadcast_from_first(info, process_set, "espresso.plan")
        self._info = info
        self._choice = dict(info["choice"])
        if rank == 0:
            counts: dict = {}
            for row in info["report"]:
                counts[row["option"]] = counts.get(row["option"], 0) + 1
            what = ", ".join(f"{c} {name}" for name, c in sorted(counts.items(), key=lambda kv: -kv[1]))
            alpha, beta = info["link"]
            log.info("espresso: %d gradients: %s; modelled iteration %.3f ms (all dense %.3f ms, all compressed "
                     "%.3f ms); link %.1f us + %.3g ns/B over %d ranks", len(info["report"]), what or "none",
                     info["predicted"] * 1e3, info["predicted_dense"] * 1e3,
                     info["predicted_all_compressed"] * 1e3, alpha * 1e6, beta * 1e9, info["ranks"])

    # -- reports ---------------------------------------------------------------------------------------
    def report(self) -> list:
        """One dict per profiled key, in backward order: ``name``, ``size`` (elements), ``bytes`` (dense),
        ``option`` (the decision's) and ``predicted_saving_s`` (modelled seconds per iteration lost if that
        gradient alone went back to dense). Empty before the decision."""
        return [dict(r) for r in self._info.get("report", [])]

    def format_report(self) -> str:
        """:meth:`report` as a text table, with the modelled iteration times."""
        rows = self.report()
        if not rows:
            return "espresso: no decision yet"
        w = max(4, max(len(r["name"]) for r in rows))
        wo = max(6, max(len(r["option"]) for r in rows))
        lines = [f"{'name':<{w}}  {'elements':>10}  {'option':<{wo}}  {'saving ms':>9}"]
        for r in rows:
            lines.append(f"{r['name']:<{w}}  {r['size']:>10}  {r['option']:<{wo}}  "
                         f"{r['predicted_saving_s'] * 1e3:>9.3f}")
        i = self._info
        lines.append(f"modelled iteration: {i['predicted'] * 1e3:.3f} ms (all dense {i['predicted_dense'] * 1e3:.3f}"
                     f" ms, all compressed {i['predicted_all_compressed'] * 1e3:.3f} ms); policy {self.policy}")
        return "\n".join(lines)

    # -- the work --------------------------------------------------------------------------------------
    def reduce_async(self, key: str, arrays: Sequence[np.ndarray], outputs: Optional[Sequence[np.ndarray]] = None,
                     op=ReduceOp.AVERAGE, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Pending:
        """As :meth:`Reducer.reduce_async`, through the option chosen for ``key``."""
        if not key:
            raise ValueError("perseus: Espresso keeps state per tensor and needs a name; pass name= "
                             "(DistributedOptimizer names gradients after their parameters)")
        with self._rlock:
            if self._choice is None:
                new_step = self.profiler.arrive(key)
                if new_step and self.profiler.step == self.warmup_steps + self.profile_steps:
                    self.profiler.steps.pop()
                    self._decide_now(process_set)
            if not self._autotune_asked:
                self._autotune, _ = _attach_autotune(self)
                self._autotune_asked = True
            if self._autotune is not None:  # at a step boundary: the policy every rank uses for this step
                code = self._autotune.at_call(key, process_set)
                if code is not None:
                    self.policy, self._pending_policy = POLICIES[code], None
            if self._choice is None:
                dense = self.candidates[0]
                t0 = time.perf_counter()
                pending = dense.reduce_async(key, arrays, outputs, op, prescale_factor, postscale_factor,
                                             process_set)
                self.profiler.record(key, sum(a.size for a in arrays), t0, time.perf_counter() - t0, 0)
                return pending
            if key in self._seen:
                self._seen = set()
                if self._pending_policy is not None:
                    self.policy, self._pending_policy = self._pending_policy, None
            self._seen.add(key)
            reducer = self.candidates[self.option_of(key)]
        return reducer.reduce_async(key, arrays, outputs, op, prescale_factor, postscale_factor, process_set)
