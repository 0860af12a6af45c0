"""Helpers for MPI tests that start a new job with other settings (autotuning, wire counters, ...)."""

import os

#: the engine parameters (PERSEUS_AUTOTUNE_FIXED: keep them, so that only a step-aligned dimension is searched)
ENGINE_PARAMS = "fusion_threshold_bytes,inplace_threshold_bytes,channels,cycle_time_us,algorithm"


def restart(hvd, env):
    """Shut perseus down on every rank, set (value) or unset (None) the variables of ``env``, init again.
    Collective. Returns the previous values, to give back to restart() afterwards."""
    old = {k: os.environ.get(k) for k in env}
    hvd.shutdown()
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    hvd.init()
    return old


def autotune_env(**extra):
    """A short autotuning job without a cache, searching only the step-aligned dimensions; ``extra``
    overrides (None unsets)."""
    env = {"PERSEUS_AUTOTUNE": "1", "PERSEUS_AUTOTUNE_BUDGET_STEPS": "24", "PERSEUS_AUTOTUNE_STEPS_PER_SAMPLE": "2",
           "PERSEUS_AUTOTUNE_WARMUP_SAMPLES": "0", "PERSEUS_CACHE_DIR": "/proc/perseus-test-no-cache",
           "PERSEUS_AUTOTUNE_FIXED": ENGINE_PARAMS, "PERSEUS_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": None,
           "PERSEUS_AUTOTUNE_RETUNE_DRIFT": None, "PERSEUS_SPARSE_ALGORITHM": None,
           "PERSEUS_DEAR_THRESHOLD_BYTES": None}
    env.update(extra)
    return env


def steps_until_tuned(hvd, tuner, step, steps=None, max_steps=400, name="until_tuned"):
    """Call ``step()`` until the job's tuner is done on every rank, then 3 times more (or ``steps`` times when
    given); return how many times. Collective: every rank agrees each step (a MIN all-reduce) on whether every
    tuner is done, so every rank stops at the same step."""
    import torch

    n, extra = 0, None
    while (steps is not None and n < steps) or (steps is None and (extra is None or extra > 0)):
        if steps is None:
            if extra is None:
                done = hvd.allreduce(torch.tensor([1.0 if tuner.done else 0.0]), name=name, op=hvd.Min)
                if done.item() == 1.0 and n >= 5:
                    extra = 3
            else:
                extra -= 1
        step()
        n += 1
        assert n < max_steps, "the tuner did not finish within its budget"
    return n
