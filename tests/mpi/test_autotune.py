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
    from perseus.common.basics import state

    tuner = state()._tuner
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
        from perseus.common.basics import state

        params = tuple(state().engine.params(0))
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
    from perseus.common.basics import state

    env = {"PERSEUS_AUTOTUNE": "1", "PERSEUS_AUTOTUNE_BUDGET_STEPS": "12", "PERSEUS_AUTOTUNE_STEPS_PER_SAMPLE": "2",
           "PERSEUS_AUTOTUNE_WARMUP_SAMPLES": "0", "PERSEUS_AUTOTUNE_RETUNE_DRIFT": "0.5",
           "PERSEUS_CACHE_DIR": "/proc/perseus-test-no-cache"}
    old = {k: os.environ.get(k) for k in env}
    try:
        restart(hvd, env)
        tuner = state()._tuner
        slow, tuned_at, took, pause = False, None, [], None
        for step in range(1200):
            t0 = time.perf_counter()
            xs = [torch.ones(s) for s in SIZES]
            handles = [hvd.allreduce_async_(x, name=f"drift.g{i}", op=hvd.Sum) for i, x in enumerate(xs)]
            if slow:
                # The steps get slower on all ranks, by at least as long as a step took (a loaded machine
                # makes steps long): the tuner must notice a drift of more than 50%.
                if pause is None:
                    pause = max(0.004, 1.5 * sorted(took)[len(took) // 2])
                time.sleep(pause)
            for h in handles:
                hvd.synchronize(h)
            if not slow:
                took = (took + [time.perf_counter() - t0])[-100:]
            state_now = hvd.allreduce(torch.tensor([float(tuner.result is not None), float(tuner.searches)]),
                                      name="drift.state", op=hvd.Min)
            tuned, searches = state_now.tolist()
            if tuned and tuned_at is None:
                tuned_at = step
            # Slow down once the tuner has taken its first 50-step measure after tuning.
            slow = tuned_at is not None and step >= tuned_at + 120
            if searches >= 2:
                break
        assert searches >= 2, "a slowdown of the steps did not start a new search"
    finally:
        restart(hvd, old)
