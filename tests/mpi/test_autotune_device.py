"""The device buckets' budget as a dimension of the run-time tuner, in a real job whose all-reduces go through the
GPU launcher (on Gloo, as PERSEUS_DEVICE_BACKEND=gloo does): the tuner tries more than one budget, every rank
ends with the one chosen, training stays identical on every rank and equal to the host path's, and an explicit
PERSEUS_DEVICE_BUCKET_BYTES is kept."""

import os
import random
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from job_env import autotune_env, restart, steps_until_tuned

pytest.importorskip("optuna")

pytestmark = pytest.mark.timeout(280)  # for hangs


def _env(**extra):
    return autotune_env(**{"PERSEUS_AUTOTUNE_BUDGET_STEPS": "30", "PERSEUS_DEVICE_BACKEND": "gloo",
                           "PERSEUS_DEVICE_BUCKET_BYTES": None, **extra})


def model():
    torch.manual_seed(0)
    layers = [nn.Linear(32, 512)]
    for _ in range(8):  # 1 MB a layer: the candidate budgets (4 ... 256 MB) bucket them differently
        layers += [nn.Linear(512, 512), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(512, 10))


def _train(hvd, net, steps=None, on_step=None):
    """SGD steps until the tuner is done on every rank (and 3 more), or ``steps``; returns the tuner, the budget
    in force after each step and the steps taken. ``on_step()`` runs after each step."""
    from perseus.runtime.state import runtime

    tuner = runtime().service("tuner")
    engine = runtime().engine
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=net.named_parameters())
    g = torch.Generator().manual_seed(100 + hvd.rank())
    rng = random.Random(hvd.rank())
    budgets = []

    def step():
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        if hvd.rank() % 2 == 1:
            time.sleep(rng.uniform(0, 0.004))
        opt.step()
        budgets.append(engine.params(0)[6])
        if on_step is not None:
            on_step()
    n = steps_until_tuned(hvd, tuner, step, steps, name="dev.tuned")
    return tuner, budgets, n


def _flat(net):
    return torch.cat([p.detach().flatten() for p in net.parameters()])


def test_bucket_budget_is_searched_and_applied_on_every_rank(hvd):
    from perseus.autotune.space import DEVICE_BUCKETS

    env = _env()
    old = {k: os.environ.get(k) for k in env}
    try:
        restart(hvd, env)
        net = model()
        tuner, budgets, steps = _train(hvd, net)
        assert tuner._tuned["device_bucket"]
        assert len(set(budgets)) > 1, f"the search tried one budget only: {budgets}"
        assert set(budgets[-3:]) == {tuner.result.device_bucket_bytes}
        assert tuner.result.device_bucket_bytes in DEVICE_BUCKETS
        everyone = hvd.allgather_object((budgets[-1], tuner.result))
        assert all(e == everyone[0] for e in everyone), "ranks ended with different budgets"
        params = hvd.allgather(_flat(net).unsqueeze(0), name="dev.tuned.params")
        for r in range(hvd.size()):
            torch.testing.assert_close(params[r], params[0], rtol=0, atol=0)
        # The same steps through perseus's CPU channels (no launcher, no tuner): the same parameters.
        restart(hvd, {"PERSEUS_AUTOTUNE": None, "PERSEUS_DEVICE_BACKEND": None})
        ref = model()
        _train(hvd, ref, steps=steps)
        # (Gloo and perseus's channels sum 3 or more ranks in different orders: rounding, over tens of steps)
        torch.testing.assert_close(_flat(net), _flat(ref), rtol=1e-4, atol=2e-4)
    finally:
        restart(hvd, old)


def test_explicit_budget_is_kept(hvd):
    env = _env(PERSEUS_DEVICE_BUCKET_BYTES=str(8 << 20), PERSEUS_AUTOTUNE_FIXED="explicit",
               PERSEUS_AUTOTUNE_BUDGET_STEPS="8")
    old = {k: os.environ.get(k) for k in env}
    try:
        restart(hvd, env)
        tuner, budgets, _ = _train(hvd, model())
        assert not tuner._tuned["device_bucket"] and set(budgets) == {8 << 20}
    finally:
        restart(hvd, old)


def test_gpu_path_is_searched_and_switches_at_the_same_step(hvd):
    """The path itself (the launcher, or host memory: here the engine's CPU channels) is a dimension: every rank
    switches at the same step, the final path is the chosen one, and training equals the host path's."""
    from job_env import ENGINE_PARAMS
    from perseus.torch import device

    env = _env(PERSEUS_AUTOTUNE_FIXED=ENGINE_PARAMS + ",device_bucket")
    old = {k: os.environ.get(k) for k in env}
    launched = []
    real = device._Launcher._launch

    def count(self, *args):
        launched[-1] += 1
        return real(self, *args)
    try:
        restart(hvd, env)
        device._Launcher._launch = count
        net = model()
        launched.append(0)  # launches during each step (the last entry counts the step under way)
        tuner, budgets, steps = _train(hvd, net, on_step=lambda: launched.append(0))
        assert tuner._tuned["device_path"], "the GPU path was not searched"
        paths = [n > 0 for n in launched[:steps]]
        assert True in paths and False in paths, f"one path only: {paths}"
        everyone = hvd.allgather_object((paths, tuner.result))
        assert all(e == everyone[0] for e in everyone), "ranks switched at different steps"
        assert paths[-1] == (tuner.result.device_path == 0)
        restart(hvd, {"PERSEUS_AUTOTUNE": None, "PERSEUS_DEVICE_BACKEND": None})
        ref = model()
        _train(hvd, ref, steps=steps)
        # (Gloo and perseus's channels sum 3 or more ranks in different orders: rounding, over tens of steps)
        torch.testing.assert_close(_flat(net), _flat(ref), rtol=1e-4, atol=2e-4)
    finally:
        device._Launcher._launch = real
        restart(hvd, old)
