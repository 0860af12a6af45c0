"""Espresso's policy as a dimension of the run-time tuner, in a real job: every rank uses the same policy at
every training step (however differently the ranks and their tuner threads are timed), the tuner tries more
than one policy, the per-step agreement stops at the same step everywhere once the final setting is in force,
parameters stay identical on every rank, and a second run of the same job applies the remembered policy."""

import os
import random
import time

import pytest
import torch
import torch.nn as nn

from job_env import ENGINE_PARAMS, autotune_env, restart

pytest.importorskip("optuna")

pytestmark = pytest.mark.timeout(280)

def _env(**extra):
    return autotune_env(**{"PERSEUS_AUTOTUNE_FIXED": "none", **extra})


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _train_until_tuned(hvd, es, model, max_steps=400, jitter=True):
    """Train until every rank's tuner has finished, then 3 steps more. Returns the tuner, per step what this
    rank used: (policy, option of every gradient, whether the per-step agreement had stopped), and a function
    that trains n steps more."""
    from perseus.runtime.state import runtime

    tuner = runtime().service("tuner")
    assert tuner is not None
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=es)
    keys = [f"grad.{n}" for n, _ in model.named_parameters()]
    g = torch.Generator().manual_seed(100 + hvd.rank())
    rng = random.Random(hvd.rank())

    def step():
        x = torch.randn(16, 8, generator=g)
        y = torch.randn(16, 4, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if jitter and hvd.rank() % 2 == 1:
            time.sleep(rng.uniform(0, 0.004))  # this rank is slower, irregularly
        opt.step()

    def more(n):
        for _ in range(n):
            step()

    record, steps, extra = [], 0, None
    while extra is None or extra > 0:
        if extra is None:
            # Every rank runs the same steps: stop once every rank's tuner thread has ended.
            finished = hvd.allreduce(torch.tensor([1.0 if tuner.done else 0.0]), name="policy.tuned", op=hvd.Min)
            if finished.item() == 1.0 and steps >= 5:
                extra = 3  # the final setting is applied at the next step boundary
        else:
            extra -= 1
        step()
        follower = es._autotune
        record.append((es.policy, tuple(es.option_of(k) for k in keys),
                       None if follower is None else follower.finished))
        steps += 1
        assert steps < max_steps, "the tuner did not finish within its budget"
    return tuner, record, more


def _flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _check_same_everywhere(hvd, es, model, tuner, record):
    everyone = hvd.allgather_object((record, tuner.result, es.policy, es._autotune.steps))
    for r, theirs in enumerate(everyone):
        assert theirs[0] == record, f"rank {r} used other policies at some step than rank {hvd.rank()}"
        assert theirs[1:] == everyone[0][1:], everyone
    params = hvd.allgather(_flat(model).unsqueeze(0), name="policy.params")
    for r in range(hvd.size()):
        torch.testing.assert_close(params[r], params[0], rtol=0, atol=0, msg=f"rank {r} parameters differ")
    # The final setting's policy is in force and the per-step agreement has stopped, at the same step on every
    # rank (the record's last field is part of what was compared above).
    assert es.policy == tuner.result.policy_name
    assert record[-1][2] is True


def test_policy_switches_at_the_same_step_on_every_rank(hvd, tmp_path):
    from perseus.compression.espresso import Espresso

    cache = hvd.broadcast_object(str(tmp_path / "cache"), root_rank=0)  # one directory for every rank
    # Only the policy is searched: three points, so the search certainly tries more than one.
    env = _env(PERSEUS_AUTOTUNE_FIXED=ENGINE_PARAMS, PERSEUS_CACHE_DIR=cache)
    old = {k: os.environ.get(k) for k in env}
    try:
        restart(hvd, env)
        es = Espresso(density=0.1)
        model = mlp()
        tuner, record, more = _train_until_tuned(hvd, es, model)
        assert es._autotune is not None and es.decided
        _check_same_everywhere(hvd, es, model, tuner, record)
        policies = {p for p, _, _ in record}
        assert len(policies) >= 2, policies
        assert tuner.samples >= 3
        # A policy changes the collectives: 'dense' sends every gradient dense, 'all-compressed' none.
        for policy, options, _ in record:
            if policy == "dense":
                assert set(options) == {0}
            elif policy == "all-compressed":
                assert 0 not in options
        # Steps stop costing an all-reduce: no more boundaries pass through the agreement.
        before = es._autotune.steps
        more(3)
        assert es._autotune.steps == before
        # The same job again: the stored setting, policy included, is applied at once, without a search.
        first = tuner.result
        restart(hvd, env)
        es2 = Espresso(density=0.1)
        model2 = mlp()
        again, record2, _ = _train_until_tuned(hvd, es2, model2, max_steps=80)
        assert again.samples == 0 and again.result == first
        _check_same_everywhere(hvd, es2, model2, again, record2)
    finally:
        restart(hvd, old)


def test_policy_and_engine_parameters_searched_together(hvd):
    from perseus.compression.espresso import Espresso

    env = _env(PERSEUS_AUTOTUNE_BUDGET_STEPS="30")
    old = {k: os.environ.get(k) for k in env}
    try:
        restart(hvd, env)
        es = hvd.Compression.espresso(density=0.1)
        other = Espresso(density=0.1)  # only one Espresso per job follows the tuner: the first one created
        model = mlp()
        from perseus.runtime.state import runtime

        tuner = runtime().service("tuner")
        if hvd.rank() == 1:  # this rank's tuner hears of every setting late: its compressor must wait for it
            link = tuner.policy
            post, proposal = link.post, link.proposal
            waiting = [0]  # the highest proposal this rank's compressor has waited for before it was posted

            def watched_proposal(number, timeout=None):
                if number > link.posted:
                    waiting[0] = max(waiting[0], number)
                return proposal(number) if timeout is None else proposal(number, timeout)

            def late_post(policy, done=False):
                # Hold the proposal until this rank's compressor waits for it at a step boundary (whatever the
                # machine's speed); bounded below the compressor's own wait, so a compressor that never waits
                # fails the assertion below instead of hanging.
                deadline = time.monotonic() + 20.0
                while waiting[0] <= link.posted and time.monotonic() < deadline:
                    time.sleep(0.002)
                post(policy, done)
            link.proposal = watched_proposal
            link.post = late_post
        tuner, record, more = _train_until_tuned(hvd, es, model)
        assert other._autotune is None
        _check_same_everywhere(hvd, es, model, tuner, record)
        assert hvd.allreduce(torch.tensor([es._autotune.waits]), name="policy.waits", op=hvd.Sum).item() >= 1
        assert tuple(runtime().engine.params(0))[:5] == tuner.result.values()
        assert tuner.samples >= 3
    finally:
        restart(hvd, old)


def test_explicit_policy_is_kept(hvd):
    env = _env(PERSEUS_AUTOTUNE_FIXED="explicit", PERSEUS_AUTOTUNE_BUDGET_STEPS="12")
    old = {k: os.environ.get(k) for k in env}
    try:
        restart(hvd, env)
        es = hvd.Compression.espresso(density=0.1)
        es.set_policy("all-compressed")
        model = mlp()
        tuner, record, more = _train_until_tuned(hvd, es, model, jitter=False)
        assert {p for p, _, _ in record} == {"all-compressed"}
        everyone = hvd.allgather_object(record)
        assert all(r == record for r in everyone)
        assert record[-1][2] is True  # the per-step agreement stopped all the same
    finally:
        restart(hvd, old)
