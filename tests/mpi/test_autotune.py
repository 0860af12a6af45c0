"""The run-time tuner in a real job: ranks with different timings switch settings together, the results
stay right, the search ends within its budget, and a second run of the same job reuses the stored setting."""

import os
import random
import time

import numpy as np
import pytest
import torch

from job_env import restart

pytest.importorskip("optuna")

pytestmark = pytest.mark.timeout(240)

SIZES = (3, 1000, 70001, 300000, 5)


def _train_until_tuned(hvd, max_steps=600):
    from perseus.runtime.state import runtime

    tuner = runtime().service("tuner")
    assert tuner is not None
    rng = random.Random(hvd.rank())
    n = hvd.size()
    steps = 0
    while True:
        # Every rank must run the same number of steps: stop once every rank's tuner has finished.
        finished = hvd.allreduce(torch.tensor([1.0 if tuner.done else 0.0]), name="tune.done", op=hvd.Min)
        if finished.item() == 1.0 and steps >= 5:
            break
        xs = [torch.full((s,), float(hvd.rank() + 1)) for s in SIZES]
        handles = []
        for i, x in enumerate(xs):
            handles.append(hvd.allreduce_async_(x, name=f"tune.g{i}", op=hvd.Sum))
            if hvd.rank() % 2 == 1:
                time.sleep(rng.uniform(0, 0.003))  # this rank is slower, irregularly
        for h in handles:
            hvd.synchronize(h)
        for x in xs:
            assert torch.equal(x, torch.full_like(x, n * (n + 1) / 2))
        steps += 1
        assert steps < max_steps, "the tuner did not finish within its budget"
    return tuner, steps


def test_tuner_switches_every_rank_together_and_remembers(hvd, tmp_path):
    cache = hvd.broadcast_object(str(tmp_path / "cache"), root_rank=0)  # one directory for every rank
    env = {"PERSEUS_AUTOTUNE": "1", "PERSEUS_AUTOTUNE_BUDGET_STEPS": "30", "PERSEUS_AUTOTUNE_STEPS_PER_SAMPLE": "2",
           "PERSEUS_AUTOTUNE_WARMUP_SAMPLES": "0", "PERSEUS_CACHE_DIR": cache, "PERSEUS_AUTOTUNE_FIXED": "none",
           "PERSEUS_FUSION_THRESHOLD": str(64 << 10)}
    old = {k: os.environ.get(k) for k in env}
    try:
        restart(hvd, env)
        tuner, steps = _train_until_tuned(hvd)
        from perseus.runtime.state import runtime

        params = tuple(runtime().engine.params(0))
        everyone = hvd.allgather_object((params, tuner.result, tuner.samples))
        assert all(e == everyone[0] for e in everyone), everyone
        assert params[:5] == tuner.result.values() and tuner.samples >= 3
        # The same job again: the stored setting is applied at once, without a search.
        restart(hvd, env)
        again, _ = _train_until_tuned(hvd, max_steps=60)
        assert again.samples == 0 and again.result == tuner.result
    finally:
        restart(hvd, old)


def test_tuner_searches_again_when_steps_slow_down(hvd, tmp_path):
    """The re-tune trigger, driven by the step times the tuner reads (not by the machine's speed): every step
    takes 1 ms until the test makes every later step take 10 ms."""
    from perseus.runtime.state import runtime

    env = {"PERSEUS_AUTOTUNE": "1", "PERSEUS_AUTOTUNE_BUDGET_STEPS": "12", "PERSEUS_AUTOTUNE_STEPS_PER_SAMPLE": "2",
           "PERSEUS_AUTOTUNE_WARMUP_SAMPLES": "0", "PERSEUS_AUTOTUNE_RETUNE_DRIFT": "0.5",
           "PERSEUS_CACHE_DIR": "/proc/perseus-test-no-cache"}
    old = {k: os.environ.get(k) for k in env}
    try:
        restart(hvd, env)
        tuner = runtime().service("tuner")
        real = tuner.read_steps
        slow_from = [float("inf")]  # the index of the first slow step

        def chosen_times(ps_id, since):
            first, steps = real(ps_id, since)
            return first, [(0.010 if first + i >= slow_from[0] else 0.001,) + tuple(step[1:])
                           for i, step in enumerate(steps)]

        tuner.read_steps = chosen_times
        tuned_at, searches = None, 0
        # The tuner reads the steps on its own thread: on a loaded machine it may lag many steps behind, so
        # the loop ends on time (every rank at the same step: the flag is reduced), not on a step count.
        deadline = time.monotonic() + 150
        step = -1
        while True:
            step += 1
            handles = [hvd.allreduce_async_(torch.ones(s), name=f"drift.g{i}", op=hvd.Sum) for i, s in enumerate(SIZES)]
            for h in handles:
                hvd.synchronize(h)
            late = -float(time.monotonic() > deadline)  # Min of the negated flag: any rank past its deadline
            state_now = hvd.allreduce(torch.tensor([float(tuner.result is not None), float(tuner.searches), late]),
                                      name="drift.state", op=hvd.Min)
            tuned, searches, late = state_now.tolist()
            if late < 0 and step >= 3000:
                break
            if tuned and tuned_at is None:
                tuned_at = step
            # Slow down once the tuner's first 50-step measure after tuning lies behind.
            if tuned_at is not None and step >= tuned_at + 120 and slow_from[0] == float("inf"):
                first, steps = real(0, 0)
                slow_from[0] = first + len(steps)
            if searches >= 2:
                break
        assert tuned_at is not None, "the tuner never finished its first search"
        assert searches >= 2, "a slowdown of the steps did not start a new search"
    finally:
        restart(hvd, old)


def test_a_failing_search_is_reported_once_and_the_job_goes_on(hvd, tmp_path, monkeypatch):
    """Rank 0's search raising (Optuna or the bandit) ends the search on every rank, keeps the best setting
    measured so far, and says so once on the perseus log with the cause."""
    import logging

    from perseus.autotune import tuner as tuner_module

    calls = [0]
    real_next = tuner_module.Search.next

    def failing_next(self):
        calls[0] += 1
        if calls[0] >= 2:
            raise RuntimeError("planted search failure")
        return real_next(self)

    monkeypatch.setattr(tuner_module.Search, "next", failing_next)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("perseus").addHandler(handler)
    env = {"PERSEUS_AUTOTUNE": "1", "PERSEUS_AUTOTUNE_BUDGET_STEPS": "30", "PERSEUS_AUTOTUNE_STEPS_PER_SAMPLE": "2",
           "PERSEUS_AUTOTUNE_WARMUP_SAMPLES": "0", "PERSEUS_CACHE_DIR": "/proc/perseus-test-no-cache"}
    old = {k: os.environ.get(k) for k in env}
    try:
        restart(hvd, env)
        tuner, _ = _train_until_tuned(hvd)
        assert tuner.result is not None
        if hvd.rank() == 0:
            assert tuner.failure == "RuntimeError: planted search failure"
            said = [r.getMessage() for r in records if "search failed" in r.getMessage()]
            assert len(said) == 1 and "planted search failure" in said[0], said
        everyone = hvd.allgather_object(tuner.result)
        assert all(e == everyone[0] for e in everyone), everyone
    finally:
        logging.getLogger("perseus").removeHandler(handler)
        restart(hvd, old)
