"""PERSEUS_NONFINITE_GRADIENTS: NaN/Inf in one rank's gradient is caught before it spreads; every rank raises
(naming the tensor and the rank) or skips the step at the same step; 'off' leaves it alone."""

import os

import pytest
import torch
import torch.nn as nn

from perseus.base.exceptions import NonFiniteGradientError

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def guard_mode(request):
    old = os.environ.get("PERSEUS_NONFINITE_GRADIENTS")
    os.environ["PERSEUS_NONFINITE_GRADIENTS"] = request.param
    yield request.param
    if old is None:
        os.environ.pop("PERSEUS_NONFINITE_GRADIENTS", None)
    else:
        os.environ["PERSEUS_NONFINITE_GRADIENTS"] = old


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def batch(hvd, step):
    g = torch.Generator().manual_seed(10 * step + hvd.rank())
    return torch.randn(6, 4, generator=g)


def train_step(hvd, model, opt, step, poison_rank=None, poison_step=None, value=float("nan")):
    opt.zero_grad()
    x = batch(hvd, step)
    if hvd.rank() == poison_rank and step == poison_step:
        x = x.clone()
        x[0, 0] = value  # reaches every weight gradient of the first layer
    model(x).square().mean().backward()
    return opt.step()


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("guard_mode", ["raise"], indirect=True)
@pytest.mark.parametrize("groups", [None, 1])
def test_raise_names_tensor_and_rank_on_every_rank(hvd, guard_mode, groups):
    model = net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), groups=groups)
    train_step(hvd, model, opt, 0)
    before = flat(model)
    bad = hvd.size() - 1
    with pytest.raises(NonFiniteGradientError, match=rf"rank {bad}: .*grad\.0\.weight") as info:
        train_step(hvd, model, opt, 1, poison_rank=bad, poison_step=1)
    assert f"(rank {bad} of the process set)" in str(info.value) and "optimizer step 1" in str(info.value)
    torch.testing.assert_close(flat(model), before, rtol=0, atol=0)  # nothing was applied
    # the job goes on: the next step is clean
    train_step(hvd, model, opt, 2)
    assert torch.isfinite(flat(model)).all()


@pytest.mark.parametrize("guard_mode", ["skip"], indirect=True)
def test_skip_skips_the_step_everywhere_and_training_goes_on(hvd, guard_mode):
    model, ref = net(), net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    ref_opt = hvd.DistributedOptimizer(torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=[("ref." + n, p) for n, p in ref.named_parameters()])
    for step in range(4):
        train_step(hvd, model, opt, step, poison_rank=0, poison_step=2, value=float("inf"))
        if step != 2:  # the reference never sees step 2
            train_step(hvd, ref, ref_opt, step)
    torch.testing.assert_close(flat(model), flat(ref), rtol=1e-6, atol=1e-7)
    assert opt._schedule.guard.skipped == 1
    everyone = hvd.allgather_object(flat(model).tolist())
    assert all(e == everyone[0] for e in everyone)


@pytest.mark.parametrize("guard_mode", ["skip"], indirect=True)
def test_skip_keeps_a_compressor_clean(hvd, guard_mode):
    model, ref = net(), net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=hvd.Compression.topk(0.5))
    for step in range(4):
        train_step(hvd, model, opt, step, poison_rank=0, poison_step=1)
    assert torch.isfinite(flat(model)).all()  # the error-feedback memory never held the NaN


@pytest.mark.parametrize("guard_mode", ["raise"], indirect=True)
def test_sparse_gradient_checked(hvd, guard_mode):
    emb = nn.Embedding(10, 3, sparse=True)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                   named_parameters=[("emb.weight", emb.weight)])
    opt.zero_grad()
    out = emb(torch.tensor([1, 2, hvd.rank() % 10]))
    (out.sum() * (float("nan") if hvd.rank() == 0 else 1.0)).backward()
    with pytest.raises(NonFiniteGradientError, match=r"rank 0: grad\.emb\.weight"):
        opt.step()


@pytest.mark.parametrize("guard_mode", ["off"], indirect=True)
def test_off_checks_nothing(hvd, guard_mode):
    model = net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    assert opt._schedule.guard is None
    train_step(hvd, model, opt, 0, poison_rank=0, poison_step=0)
    assert not torch.isfinite(flat(model)).all()  # the NaN reached every rank, as without a guard


@pytest.mark.parametrize("guard_mode", ["raise"], indirect=True)
def test_unsupported_optimizers_refuse(hvd, guard_mode):
    p = nn.Parameter(torch.ones(2))
    with pytest.raises(NotImplementedError, match="PERSEUS_NONFINITE_GRADIENTS=raise"):
        hvd.DistributedOptimizer(torch.optim.SGD([p], lr=0.1), op=hvd.Adasum)
    with pytest.raises(NotImplementedError, match="schedule='dear'"):
        hvd.DistributedOptimizer(torch.optim.SGD([p], lr=0.1), schedule="dear")


def test_bad_mode_is_a_clear_error(hvd):
    old = os.environ.get("PERSEUS_NONFINITE_GRADIENTS")
    os.environ["PERSEUS_NONFINITE_GRADIENTS"] = "sometimes"
    try:
        with pytest.raises(ValueError, match="PERSEUS_NONFINITE_GRADIENTS"):
            hvd.DistributedOptimizer(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1))
    finally:
        if old is None:
            os.environ.pop("PERSEUS_NONFINITE_GRADIENTS")
        else:
            os.environ["PERSEUS_NONFINITE_GRADIENTS"] = old
