"""DeAR's fusion-group size as a dimension of the run-time tuner, in a real job: the tuner tries more than one
size, every rank regroups at the same step (identical groups at every step, ranks timed differently),
training stays identical on every rank and equal to the default schedule's, and an explicit
PERSEUS_DEAR_THRESHOLD_BYTES is kept."""

import os
import random
import time

import pytest
import torch
import torch.nn as nn

from job_env import autotune_env, restart, steps_until_tuned

pytest.importorskip("optuna")

pytestmark = pytest.mark.timeout(280)

def _env(**extra):
    return autotune_env(**{"PERSEUS_AUTOTUNE_BUDGET_STEPS": "30", **extra})


def model():
    torch.manual_seed(0)
    # layers of 1 MB and more, so that the candidate sizes (256 KB ... 64 MB) group them differently
    return nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1024),
                         nn.ReLU(), nn.Linear(1024, 4))


def _train(hvd, net, schedule, steps=None):
    from perseus.runtime.state import runtime

    tuner = runtime().service("tuner")
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=net.named_parameters(), schedule=schedule)
    g = torch.Generator().manual_seed(100 + hvd.rank())
    rng = random.Random(hvd.rank())
    record = []

    def step():
        x = torch.randn(8, 512, generator=g)
        opt.zero_grad()
        net(x).square().mean().backward()
        if hvd.rank() % 2 == 1:
            time.sleep(rng.uniform(0, 0.004))
        opt.step()
        if schedule == "dear":
            following = opt._schedule.following
            follower = following.follower if following is not None else None
            record.append((len(opt.dear_groups()), opt._dear_threshold,
                           None if follower is None else follower.finished))
    n = steps_until_tuned(hvd, tuner, step, steps, name="dear.tuned")
    opt.synchronize()  # the last deferred update
    return tuner, record, n


def _flat(net):
    return torch.cat([p.detach().flatten() for p in net.parameters()])


def test_dear_group_size_is_searched_and_switches_at_the_same_step(hvd):
    env = _env()
    old = {k: os.environ.get(k) for k in env}
    try:
        restart(hvd, env)
        net = model()
        tuner, record, steps = _train(hvd, net, "dear")
        assert tuner._tuned["dear_threshold"]
        assert len({r[1] for r in record}) > 1, f"the search tried one group size only: {record}"
        everyone = hvd.allgather_object((record, tuner.result))
        assert all(e == everyone[0] for e in everyone), "ranks regrouped at different steps"
        assert record[-1][2] is True and record[-1][1] == tuner.result.dear_bytes
        params = hvd.allgather(_flat(net).unsqueeze(0), name="dear.tuned.params")
        for r in range(hvd.size()):
            torch.testing.assert_close(params[r], params[0], rtol=0, atol=0)
        # the same steps with the default schedule (no tuner): the same parameters
        restart(hvd, {"PERSEUS_AUTOTUNE": None})
        ref = model()
        _train(hvd, ref, "default", steps=steps)
        torch.testing.assert_close(_flat(net), _flat(ref), rtol=1e-5, atol=1e-6)
    finally:
        restart(hvd, old)


def test_explicit_threshold_is_kept(hvd):
    env = _env(PERSEUS_DEAR_THRESHOLD_BYTES=str(1 << 20), PERSEUS_AUTOTUNE_FIXED="explicit",
               PERSEUS_AUTOTUNE_BUDGET_STEPS="8")
    old = {k: os.environ.get(k) for k in env}
    try:
        restart(hvd, env)
        tuner, record, _ = _train(hvd, model(), "dear")
        assert not tuner._tuned["dear_threshold"] and {r[1] for r in record} == {1 << 20}
    finally:
        restart(hvd, old)
