"""The run-time tuner: measures training steps, searches the engine's parameters, applies the best.

Every rank runs a :class:`Tuner` thread (started by ``init()`` when HOROVOD_AUTOTUNE/PERSEUS_AUTOTUNE is
set). The engine times each step of the global process set (first submission to last completion; a step
ends when one of its names comes again). One sample is ``steps_per_sample`` steps under one setting:

1. rank 0 asks the search (:class:`~perseus.autotune.search.Search`) for a setting and broadcasts it;
2. every rank submits a TUNE request with it: the engine switches at the same negotiated point on every
   rank, whatever each rank's timing;
3. the step during which the switch happened is skipped; the next ``steps_per_sample`` steps are measured;
   their median time, the slowest rank's (an allreduce with MAX), is the sample's cost.

The steps spent searching are ordinary training steps. When the budget of steps is spent, the two best
settings are measured once more and the better one is applied for the rest of the run and remembered
(:mod:`perseus.autotune.cache`), so that a later run of the same job on the same topology starts from it
without searching. All collectives of the tuner are named ``perseus.autotune.*`` and submitted with
``Timing.NONE``: they belong to no step.

When an Espresso compressor has registered (:mod:`perseus.runtime.step_policy`) and has made its decision by the
time the search starts, its policy is one more dimension of the search: every setting then also carries a
policy, which the compressor applies at a step boundary agreed on by every rank (not through the TUNE
request), and each sample skips one more step so that none of its measured steps ran under the old policy.
The algorithm of the job's 'auto' sparse all-reduces (:mod:`perseus.sparse.choice`) is a dimension the same
way, through a second link (``self.sparse``), when the job reduces sparse tensors with ``algorithm='auto'``
before the search starts; so is the fusion-group size of a ``DistributedOptimizer(schedule='dear')``
(``self.dear``; perseus.torch.dear). These step-aligned dimensions (space.STEP_PARAMS) share one mechanism:
a link each, a flag each saying whether the search covers it (known on every rank from rank 0's word).

The budget of the device buckets (native/device_buckets.h) is one more optional dimension (space.DEVICE), searched
when the job's all-reduces went through the GPU launcher before the search started (and
PERSEUS_DEVICE_BUCKET_BYTES is not kept): it travels in the TUNE request itself (its sixth value; -1 when not
searched), so the engine switches it at the same negotiated point as the other engine values. Its link does
nothing (:class:`_InTune`). The GPU path (space.PATH: the launcher, or host memory) is a step-aligned dimension
under the same condition (PERSEUS_DEVICE_BACKEND not kept): the first DistributedOptimizer whose gradients went
through the launcher follows it through link ``self.path`` and switches at a step boundary
(perseus.torch.default_schedule).

:class:`Tuner` holds the protocol above; its collectives and step records are in
:mod:`~perseus.autotune.plumbing`, rank 0's choice of the optional dimensions in
:mod:`~perseus.autotune.dimensions`, and the parameters that keep their value in :mod:`~perseus.autotune.fixed`.
Building a :class:`Tuner` raises ValueError for an unknown name in PERSEUS_AUTOTUNE_FIXED; its thread raises
nothing: a failure is logged and the job goes on with the setting in force.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time
from typing import Optional

import numpy as np

from perseus.autotune import cache as cachelib
from perseus.autotune.log import TuneLog
from perseus.runtime.step_policy import PolicyLink
from perseus.autotune.search import Search
from perseus.autotune.dimensions import _Dimensions, _InTune
from perseus.autotune.fixed import tuned_fixed_params
from perseus.autotune.plumbing import _EnginePlumbing, _Stopped
from perseus.autotune.space import DEAR, DEVICE, OPTIONAL_PARAMS, PATH, POLICY, SPARSE, Config, Space

__all__ = ["Tuner", "tuned_fixed_params"]

log = logging.getLogger("perseus")

_WATCH_STEPS = 50     # re-tuning: steps per check
_WATCH_POLL_S = 0.2

# Messages from rank 0 to every rank: what to do with the broadcast setting.
_SAMPLE, _FINAL, _STOP = 0, 1, 2


class Tuner(_EnginePlumbing, _Dimensions):
    """One rank's side of the search; rank 0 decides, every rank applies (see the module docstring)."""

    def __init__(self, engine, settings, *, rank: int, size: int, topology: tuple, multi_host: bool):
        self.engine = engine
        #: where the tuner reads the engine's step records: ``read_steps(ps_id, start)`` returns ``(index of
        #: the first record, [(seconds, bytes, digest), ...])``. Every decision the tuner makes rests on
        #: these times, so a test can drive it with chosen times instead of the machine's speed.
        self.read_steps = engine.steps
        self.rank = rank
        self.size = size
        self.settings = settings
        self.steps_per_sample = max(1, int(settings.autotune_steps_per_sample))
        self.warmup_steps = max(0, int(settings.autotune_warmup_samples)) * self.steps_per_sample
        self.budget = max(1, int(settings.autotune_budget_steps))
        self.retune_drift = max(0.0, float(settings.autotune_retune_drift))
        self.max_samples = (int(settings.autotune_bayes_opt_max_samples)
                            if settings.is_explicit("autotune_bayes_opt_max_samples") else None)
        self.topology = topology
        fixed = tuned_fixed_params(settings)
        # The compressor policy is kept when named in PERSEUS_AUTOTUNE_FIXED or, with 'explicit', when the
        # compressor's set_policy() was called before the search (decided at the start of the search).
        self._fixed_step = {name: fixed.pop(name, None) is not None for name in OPTIONAL_PARAMS}
        self._policy_explicit_kept = settings.autotune_fixed.strip().lower() == "explicit"
        current = engine.params(0)
        self.space = Space.build(max_channels=int(current[5]), multi_host=multi_host, fixed=fixed)
        self.initial = Config(*current[:5])
        #: per step-aligned dimension: the link to what follows it (the compressor whose policy the tuner may
        #: set, the sparse all-reduce path, the DeAR optimizer) and the proposals this rank has posted to it
        self.links = {POLICY: PolicyLink("policy"), SPARSE: PolicyLink("sparse"), DEAR: PolicyLink("dear"),
                      PATH: PolicyLink("path"), DEVICE: _InTune()}
        self.policy, self.sparse, self.dear = self.links[POLICY], self.links[SPARSE], self.links[DEAR]
        self.path = self.links[PATH]
        #: whether the settings exchanged carry each of them (known on every rank)
        self._tuned = {name: False for name in OPTIONAL_PARAMS}
        self._applied_bucket: Optional[int] = None  # the device budget (index) of the last sample, when tuned
        self.search: Optional[Search] = None
        self.log = TuneLog(settings.autotune_log) if rank == 0 and settings.autotune_log else None
        self.cache_path = cachelib.path(settings)
        self.result: Optional[Config] = None
        self.samples = 0
        self.searches = 0  # searches finished or under way (re-tuning starts more)
        self.failure: Optional[str] = None  # rank 0: why the last search stopped early ("Type: message")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="perseus-autotune", daemon=True)
        self._seq = 0
        self._step = 0  # index of the next step not yet used

    # -- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Ask the thread to end (at shutdown); it leaves at its next wait."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    # -- the protocol -------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._tune()
        except _Stopped:
            pass
        except Exception as exc:  # noqa: BLE001 - the job goes on with the setting in force, and says so
            if not self._stop.is_set():
                log.warning("perseus autotune stopped: %s: %s; the job goes on with the setting in force",
                            type(exc).__name__, exc, exc_info=exc)
        finally:
            for link in self.links.values():
                link.end()  # what still follows stops (at the same step on every rank)

    def _sample(self, config: Config) -> float:
        """Apply config, skip the step in progress, measure steps_per_sample steps; the slowest rank's median."""
        relearn = self._tuned[DEVICE] and config.device_bucket != self._applied_bucket
        self._applied_bucket = config.device_bucket if self._tuned[DEVICE] else None
        self._apply(config)
        # The step in progress when the switch happened is mixed. A compressor policy switches at a step
        # boundary after the proposal was posted: at the latest at the start of the step after next. A new
        # device budget makes the engine learn its buckets again during the first whole step after it.
        at_boundary = relearn or any(self._tuned[n] and not self.links[n].done for n in OPTIONAL_PARAMS)
        self._step = self._completed() + (2 if at_boundary else 1)
        steps = self._wait_steps(self.steps_per_sample)
        local = float(np.median([s[0] for s in steps]))
        self._last_steps = steps
        return self._max(local)

    def _exchange(self, kind: int, technique: int = 0, config: Optional[Config] = None) -> tuple[int, int, Config]:
        """Rank 0's word to every rank: kind, technique, the five engine values and the optional ones
        (-1 where not tuned: then every rank's Config has 0 there and leaves that alone)."""
        msg = np.zeros(7 + len(OPTIONAL_PARAMS), np.int64)
        if self.rank == 0:
            config = config or self.initial
            msg[0], msg[1] = kind, technique
            msg[2:7] = config.values()
            for i, name in enumerate(OPTIONAL_PARAMS):
                msg[7 + i] = getattr(config, name) if self._tuned[name] else -1
        self._broadcast(msg)
        step_values = {}
        for i, name in enumerate(OPTIONAL_PARAMS):
            self._tuned[name] = int(msg[7 + i]) >= 0
            step_values[name] = max(0, int(msg[7 + i]))
        return int(msg[0]), int(msg[1]), Config(*(int(v) for v in msg[2:7]), **step_values)

    def _tune(self) -> None:
        self._wait_steps(self.warmup_steps + 1)  # first steps: negotiation of new names, allocations
        digest, step_bytes = self._last_signature()
        if self.rank == 0:
            # the other ranks learn these from the next exchange
            self._tuned[POLICY] = self._policy_dimension()
            self._tuned[SPARSE] = self._sparse_dimension()
            self._tuned[DEAR] = self._dear_dimension()
            self._tuned[DEVICE] = self._device_dimension()
            self._tuned[PATH] = self._path_dimension()
        # Rank 0 looks the job up in the cache and tells every rank whether to search, and from where.
        known = cachelib.lookup(self.cache_path, digest, self.topology, step_bytes) if self.rank == 0 else None
        for name in OPTIONAL_PARAMS:  # a remembered optional value matters only when tuned
            if known is not None and not self._tuned[name]:
                known = cachelib.Known(dataclasses.replace(known.config, **{name: 0}), known.exact)
        exact = known is not None and known.exact and self.space.contains(known.config)
        kind, _, start = self._exchange(_FINAL if exact else _SAMPLE, 0,
                                        known.config if known is not None else self.initial)
        if kind == _FINAL:
            config = start
            self._finish(config, reason=f"remembered from an earlier run ({self.cache_path})")
        else:
            if self.rank == 0 and known is not None:
                print(f"perseus autotune: starting from the setting of a similar job: "
                      f"{start.describe(**self._shown())}", file=sys.stderr, flush=True)
            config = self._search(start, digest, step_bytes)
        while self.retune_drift > 0:
            self._watch()
            config = self._search(config, digest, step_bytes)

    def _search(self, start: Config, digest: int, step_bytes: int) -> Config:
        """One search from start within the step budget; applies, remembers and returns the best setting."""
        self.samples = 0
        self.searches += 1
        self.failure = None
        if self.rank == 0:
            self.search = Search(self.space, seed=0, start=start)
            names = ["start"] + list(self.search.techniques)
        spent = 0
        while True:
            if self.rank == 0:
                over = spent >= self.budget or (self.max_samples is not None and self.samples >= self.max_samples)
                technique, proposal = ("", None) if over else self._propose()
                if proposal is None:
                    kind, _, config = self._exchange(_STOP)
                else:
                    kind, _, config = self._exchange(_SAMPLE, names.index(technique), proposal)
            else:
                kind, _, config = self._exchange(_SAMPLE)
            if kind == _STOP:
                break
            began = self._step
            cost = self._sample(config)
            spent += self._step - began + 1
            self.samples += 1
            if self.rank == 0:
                try:
                    improved = self.search.observe(technique, config, cost)
                except Exception as exc:  # noqa: BLE001 - the other ranks must still hear a decision
                    self._search_failed("recording a sample", exc)
                    improved = False
                self._report(technique, config, cost, improved)
        # Measure the two best once more (noise on a shared machine), then keep the better.
        finalists = self.search.finalists(2) if self.rank == 0 else []
        for i in range(2):
            kind, _, config = self._exchange(_SAMPLE if i < len(finalists) else _STOP,
                                             0, finalists[i] if i < len(finalists) else None)
            if kind == _STOP:
                break
            cost = self._sample(config)
            if self.rank == 0:
                self.search.observe("recheck", config, cost)
                self._report("recheck", config, cost, False, label="recheck")
        best = (self.search.best()[0] or self.initial) if self.rank == 0 else None
        kind, _, config = self._exchange(_FINAL, 0, best)
        if self.rank == 0:
            cachelib.store(self.cache_path, digest, self.topology, step_bytes, config, self.search.cost(config))
        failed = f"; the search failed: {self.failure}" if self.rank == 0 and self.failure else ""
        self._finish(config, reason=f"best of {self.samples} samples{failed}")
        return config

    def _watch(self) -> None:
        """Re-tuning (PERSEUS_AUTOTUNE_RETUNE_DRIFT > 0): return when the median step time of
        _WATCH_STEPS steps exceeded the first such median after tuning by the drift fraction twice in a row.
        Every rank compares the same allreduced values, so all decide alike."""
        baseline, strikes = None, 0
        while True:
            steps = self._wait_steps(_WATCH_STEPS, poll=_WATCH_POLL_S)
            cost = self._max(float(np.median([s[0] for s in steps])))
            if baseline is None:
                baseline = cost
                continue
            strikes = strikes + 1 if cost > baseline * (1.0 + self.retune_drift) else 0
            if strikes >= 2:
                if self.rank == 0:
                    print(f"perseus autotune: steps take {cost * 1e3:.1f} ms, up from {baseline * 1e3:.1f} ms "
                          "after tuning; searching again", file=sys.stderr, flush=True)
                return

    def _propose(self):
        """Rank 0: the next (technique, config), or (_, None) when the search fails: the other ranks wait
        for rank 0's word, so a failure here must end the search, never the thread."""
        try:
            return self.search.next()
        except Exception as exc:  # noqa: BLE001 - reported, and the search ends on every rank (below)
            self._search_failed("proposing the next sample", exc)
            return "", None

    def _search_failed(self, where: str, exc: BaseException) -> None:
        """Rank 0: the search (Optuna or the bandit) raised. Said once on the perseus log (stderr unless the
        application set up its own handlers) with the cause; the traceback at debug level. The search then
        ends and the best setting measured so far is kept (``_finish`` names the failure again)."""
        text = f"{type(exc).__name__}: {exc}"
        if self.failure is None:
            log.warning("perseus autotune: the search failed while %s (%s); it stops here and the job keeps the "
                        "best setting measured so far", where, text)
        log.debug("perseus autotune: search failure", exc_info=exc)
        self.failure = text

    def _finish(self, config: Config, reason: str) -> None:
        self._apply(config, final=True)
        self.result = config
        for name in OPTIONAL_PARAMS:  # a later search (re-tuning) keeps them: what followed follows no more
            if self._tuned[name]:
                self.space = self.space.with_choices(name, (getattr(config, name),))
        if self.rank == 0:
            line = f"perseus autotune: done ({reason}): {config.describe(**self._shown())}"
            print(line, file=sys.stderr, flush=True)
            if self.log is not None:
                self.log.close()

    def _report(self, technique: str, config: Config, cost: float, improved: bool, label: str = "") -> None:
        best, best_cost = self.search.best()
        what = label or f"sample {self.samples}"
        print(f"perseus autotune: {what} [{technique}] {config.describe(**self._shown())}: "
              f"{cost * 1e3:.1f} ms/step{' (new best)' if improved else ''}; best {best_cost * 1e3:.1f} ms",
              file=sys.stderr, flush=True)
        if self.log is not None:
            self.log.row(sample=self.samples, step=self._step, technique=technique, config=config, cost=cost,
                         best_cost=best_cost, steps=self._last_steps, policy=self._tuned[POLICY],
                         sparse=self._tuned[SPARSE], dear=self._tuned[DEAR], device=self._tuned[DEVICE],
                         path=self._tuned[PATH])
