"""Momentum correction, masking, the density warm-up, local clipping and Adam's frozen variance, under mpirun
through perseus.torch's DistributedOptimizer (perseus/compression/local_step.py, perseus/torch/_local_step.py).

With every entry sent (``topk(1.0)``) corrected training must be exactly the dense optimizer (momentum SGD;
for Adam, Adam up to the freeze and then Adam with the variance frozen); at lower densities the ranks stay
identical, the optimizer never applies momentum a second time, and the warm-up's density is the same on
every rank at every step.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from perseus.compression import Cupcake, RandomK, TopK
from perseus.compression.local_step import LocalStep

pytestmark = pytest.mark.timeout(120)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 4))


def _flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _train(hvd, model, opt, steps=12, clip=None, seed=0):
    g = torch.Generator().manual_seed(100 * hvd.rank() + seed)
    for _ in range(steps):
        x, y = torch.randn(8, 12, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
    return _flat(model)


def _same_everywhere(hvd, vec, name):
    rows = hvd.allgather(vec.unsqueeze(0), name=name)
    for r in range(hvd.size()):
        assert torch.equal(rows[r], rows[0]), f"{name}: rank {r} differs from rank 0"


def _sgd_run(hvd, compression, **sgd):
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, **sgd),
                                   named_parameters=model.named_parameters(), compression=compression)
    return _train(hvd, model, opt), opt


@pytest.mark.parametrize("sgd", [dict(momentum=0.9), dict(momentum=0.9, nesterov=True),
                                 dict(momentum=0.8, weight_decay=0.01), dict(momentum=0.9, dampening=0.2)])
@pytest.mark.parametrize("maker", [lambda: TopK(1.0), lambda: RandomK(1.0)])
def test_every_entry_sent_is_exactly_momentum_sgd(hvd, sgd, maker):
    dense, _ = _sgd_run(hvd, hvd.Compression.none, **sgd)
    corrected, opt = _sgd_run(hvd, maker(), **sgd)
    np.testing.assert_allclose(corrected.numpy(), dense.numpy(), rtol=0, atol=2e-6)
    # the user's settings are left as they were, and the optimizer kept no momentum buffer of its own
    assert opt.param_groups[0]["momentum"] == sgd["momentum"]
    assert all("momentum_buffer" not in s or s["momentum_buffer"] is None for s in opt.state.values())


def test_momentum_is_applied_once_at_low_density(hvd):
    """topk(0.25) under momentum 0.9 against a NumPy replay of the corrected algorithm on this rank's and
    the other ranks' gradients (gathered), for 3 steps."""
    model = _model()
    comp = TopK(0.25)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=comp)
    w = model[2].weight
    ref_w = w.detach().numpy().astype(np.float64).copy()
    n, size = w.numel(), hvd.size()
    u = [None] * size
    v = [np.zeros(n) for _ in range(size)]
    g = torch.Generator().manual_seed(7 + hvd.rank())
    for step in range(3):
        x, y = torch.randn(8, 12, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        grads = hvd.allgather(w.grad.detach().reshape(1, -1).clone(), name=f"mc.grads.{step}").numpy()
        opt.step()
        total = np.zeros(n)
        for r in range(size):
            gr = grads[r].astype(np.float64)
            u[r] = gr.copy() if u[r] is None else 0.9 * u[r] + gr
            v[r] += u[r]
            k = math.ceil(0.25 * n)
            idx = np.argsort(-np.abs(v[r]), kind="stable")[:k]
            total[idx] += v[r][idx]
            v[r][idx] = 0.0
            u[r][idx] = 0.0  # masking
        ref_w -= 0.1 * (total / size).reshape(ref_w.shape)
    np.testing.assert_allclose(w.detach().numpy(), ref_w, rtol=0, atol=1e-5)


def test_correction_off_keeps_the_optimizers_momentum(hvd):
    model = _model()
    comp = TopK(0.25, momentum_correction=False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=comp)
    _train(hvd, model, opt, steps=3)
    assert all(s.get("momentum_buffer") is not None for s in opt.state.values())
    assert all("velocity" not in st.extra for st in comp._states.values())


@pytest.mark.parametrize("maker", [lambda: TopK(0.05), lambda: RandomK(0.05, seed=3),
                                   lambda: Cupcake(TopK(0.05), warmup_steps=1, profile_steps=1)])
def test_low_density_keeps_ranks_identical(hvd, maker):
    params, _ = _sgd_run(hvd, maker(), momentum=0.9, nesterov=True, weight_decay=1e-3)
    assert torch.isfinite(params).all()
    _same_everywhere(hvd, params, f"mc.same.{maker().kind}")


def test_warmup_density_is_the_same_on_every_rank_and_falls_to_the_target(hvd):
    comp = TopK(0.01, warmup_steps=8, warmup_start=0.6)
    assert comp.density_at(0) == 0.6 and comp.density_at(8) == 0.01
    assert comp.density_at(4) == pytest.approx(0.6 * (0.01 / 0.6) ** 0.5)
    sizes = []
    x = torch.zeros(4000)
    for step in range(10):
        before = comp.payload_bytes
        x.copy_(torch.randn(4000, generator=torch.Generator().manual_seed(step + 10 * hvd.rank())))
        hvd.allreduce(x, name="mc.warm", compression=comp)
        sizes.append(comp.payload_bytes - before)
    gathered = hvd.allgather(torch.tensor([sizes], dtype=torch.int64), name="mc.warm.sizes")
    assert all(torch.equal(gathered[r], gathered[0]) for r in range(hvd.size()))
    # step 0 at density 0.6: 2400 (value, index) pairs would be larger than the gradient: it goes whole
    assert sizes[0] == 4 * (4000 + 16)
    assert sizes[1] == 4 * (2 * math.ceil(comp.density_at(1) * 4000) + 1)
    assert sizes[-1] == 4 * (2 * 40 + 1)
    assert sizes == sorted(sizes, reverse=True)


def test_local_clipping_bounds_every_ranks_contribution(hvd):
    """After the first clip_grad_norm_ call, each gradient is clipped on its rank before accumulation: with
    huge gradients the first step's update is clipped as a whole, every later one locally."""
    model = _model()
    comp = TopK(1.0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(), compression=comp)
    entries = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(hvd.rank())
    for step in range(3):
        before = _flat(model)
        x, y = 100 * torch.randn(8, 12, generator=g), 100 * torch.randn(8, 4, generator=g)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.clip_grad_norm_(0.5)
        opt.step()
        moved = float((_flat(model) - before).norm())
        assert moved <= 0.5 + 1e-4, (step, moved)
        if step:
            # every rank's whole gradient was clipped to 0.5 / sqrt(ranks) and every tensor to its share
            assert opt._schedule.local.clip_rms == pytest.approx(0.5 / math.sqrt(hvd.size() * entries))


def _adam_run(hvd, compression, steps, cls=torch.optim.AdamW):
    model = _model()
    opt = hvd.DistributedOptimizer(cls(model.parameters(), lr=0.01, weight_decay=0.05),
                                   named_parameters=model.named_parameters(), compression=compression)
    return _train(hvd, model, opt, steps=steps), opt


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_adam_dense_steps_then_frozen_variance(hvd, cls):
    """topk(1.0, warmup_steps=4) under Adam: exactly Adam for 4 steps, then Adam with the variance of step 4
    frozen (replayed here with torch on the averaged gradients)."""
    got, opt = _adam_run(hvd, TopK(1.0, warmup_steps=4), steps=4, cls=cls)
    dense, _ = _adam_run(hvd, hvd.Compression.none, steps=4, cls=cls)
    np.testing.assert_allclose(got.numpy(), dense.numpy(), rtol=0, atol=1e-6)
    assert opt._schedule.local.adam.frozen

    # replay: continue both from the same state; the reference freezes v by hand
    model = _model()
    ref_opt = hvd.DistributedOptimizer(cls(model.parameters(), lr=0.01, weight_decay=0.05),
                                       named_parameters=model.named_parameters(), compression=hvd.Compression.none)
    ref = ref_opt  # (the wrapped optimizer is a new instance, holding the state)
    _train(hvd, model, ref_opt, steps=4)
    frozen = {p: ref.state[p]["exp_avg_sq"].clone() for p in model.parameters()}
    m = {p: ref.state[p]["exp_avg"].clone() * 0 for p in model.parameters()}
    got_model = _model()
    got_opt = hvd.DistributedOptimizer(cls(got_model.parameters(), lr=0.01, weight_decay=0.05),
                                       named_parameters=got_model.named_parameters(),
                                       compression=TopK(1.0, warmup_steps=4))
    _train(hvd, got_model, got_opt, steps=4)
    g = torch.Generator().manual_seed(100 * hvd.rank() + 1)
    for step in range(3):
        x, y = torch.randn(8, 12, generator=g), torch.randn(8, 4, generator=g)
        for mdl, o in ((model, ref_opt), (got_model, got_opt)):
            o.zero_grad()
            F.mse_loss(mdl(x), y).backward()
        ref_opt.synchronize()  # averaged gradients in .grad, then the frozen-variance update by hand
        with torch.no_grad():
            for p in model.parameters():
                t = float(ref.state[p]["step"])
                grad = p.grad + (0.05 * p if cls is torch.optim.Adam else 0)
                scaled = grad / ((frozen[p] / (1 - 0.999 ** t)).sqrt() + 1e-8)
                m[p] = scaled.clone() if step == 0 else 0.9 * m[p] + 0.1 * scaled
                if cls is torch.optim.AdamW:
                    p.mul_(1 - 0.01 * 0.05)
                p.add_(m[p], alpha=-0.01)
        ref_opt._schedule.synchronized = False
        got_opt.step()
    np.testing.assert_allclose(_flat(got_model).numpy(), _flat(model).numpy(), rtol=0, atol=2e-5)


def test_adam_at_low_density_keeps_ranks_identical_and_counts_dense_steps(hvd):
    comp = TopK(0.1, warmup_steps=3)
    params, opt = _adam_run(hvd, comp, steps=8)
    assert torch.isfinite(params).all()
    _same_everywhere(hvd, params, "mc.adam.same")
    entries = sum(p.numel() for p in opt.param_groups[0]["params"])
    assert comp.dense_bytes == 8 * 4 * entries  # every step counted, dense or not
    assert 3 * 4 * entries < comp.payload_bytes < 8 * 4 * entries


def test_local_step_refused_by_a_compressor_without_it(hvd):
    from perseus.compression import PowerSGD

    with pytest.raises(ValueError, match="local step"):
        PowerSGD(2).reduce_async("x", [np.ones((4, 4), np.float32)], local=LocalStep(0.9))
    with pytest.raises(ValueError, match="momentum"):
        TopK(0.1).reduce_async("x", [np.ones(8, np.float32)], local=LocalStep(1.5))


def test_adam_parameter_without_state_at_the_freeze_keeps_training(hvd):
    """A parameter that joins training after the variance froze (requires_grad switched on) still moves:
    it gets ordinary Adam on its gradient."""
    model = _model()
    late = model[2].bias
    late.requires_grad_(False)
    opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), compression=TopK(0.5, warmup_steps=2))
    _train(hvd, model, opt, steps=3)
    assert opt._schedule.local.adam.frozen and late not in opt._schedule.local.adam.scale
    before = late.detach().clone()
    late.requires_grad_(True)
    _train(hvd, model, opt, steps=2, seed=5)
    assert not torch.equal(before, late.detach())
    assert "exp_avg" in opt.state[late]


def test_adam_restored_past_the_dense_phase_freezes_at_once(hvd):
    """A checkpoint (or an elastic sync) past the dense phase: the new optimizer freezes from the loaded
    state at its first gradient, on every rank alike, instead of running a second dense phase."""
    params, opt = _adam_run(hvd, TopK(0.1, warmup_steps=3), steps=5)
    saved = opt.state_dict()
    model = _model()
    fresh = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.05),
                                     named_parameters=model.named_parameters(), compression=TopK(0.1, warmup_steps=3))
    fresh.load_state_dict(saved)
    adam = fresh._schedule.local.adam
    assert not adam.frozen and adam.adam_steps() == 3
    assert not fresh._schedule.local.dense_now() and adam.frozen
    old = opt._schedule.local.adam.scale
    for p_new, p_old in zip(model.parameters(), opt.param_groups[0]["params"]):
        assert torch.equal(adam.scale[p_new], old[p_old])
