"""DistributedOptimizer(schedule="dear"): after N steps the parameters equal the default schedule's."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytestmark = [pytest.mark.timeout(120), pytest.mark.rank_count]

STEPS = 4


class Net(nn.Module):
    """Several modules of uneven sizes: conv, layer norm, three linears (one without bias)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.norm = nn.LayerNorm(64)
        self.fc1 = nn.Linear(64, 24)
        self.fc2 = nn.Linear(24, 16, bias=False)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv(x)), 2).flatten(1)
        return self.head(F.relu(self.fc2(F.relu(self.fc1(self.norm(x))))))


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
}


def batch(hvd, step, sub=0, per_rank=4):
    g = torch.Generator().manual_seed(1000 + 10 * step + sub)
    n = hvd.size() * per_rank
    x, y = torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)
    r = hvd.rank()
    return x[r * per_rank:(r + 1) * per_rank], y[r * per_rank:(r + 1) * per_rank]


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def train(hvd, schedule, opt_name="sgd", steps=STEPS, clip=None, passes=1, evaluate=False, model=None,
          start=0, state=None, torch_clip=False):
    """Train and return (model, optimizer, parameters after every step as seen by a no-grad forward)."""
    if model is None:
        torch.manual_seed(0)
        model = Net()
    opt = hvd.DistributedOptimizer(OPTIMIZERS[opt_name](model.parameters()),
                                   named_parameters=model.named_parameters(), schedule=schedule,
                                   backward_passes_per_step=passes)
    if state is not None:
        opt.load_state_dict(state)
    seen = []
    for step in range(start, start + steps):
        opt.zero_grad()
        for sub in range(passes):
            x, y = batch(hvd, step, sub)
            F.cross_entropy(model(x), y).backward()
        if torch_clip:  # Horovod's way: synchronize, clip .grad, step without synchronizing again
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            with opt.skip_synchronize():
                opt.step()
        else:
            if clip is not None:
                opt.clip_grad_norm_(clip)
            opt.step()
        if evaluate:
            model.eval()
            with torch.no_grad():
                model(batch(hvd, 99)[0])
            model.train()
            seen.append(flat(model))
    opt.synchronize()
    return model, opt, seen


@pytest.fixture(autouse=True)
def small_groups(monkeypatch):
    # About 1 KB: conv+norm, fc1 alone (6 KB), fc2, head: uneven groups.
    monkeypatch.setenv("PERSEUS_DEAR_THRESHOLD_BYTES", "1024")


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_matches_default_schedule(hvd, opt_name):
    ref, _, _ = train(hvd, "default", opt_name)
    model, opt, _ = train(hvd, "dear", opt_name)
    if hvd.size() > 1:
        assert len(opt.dear_groups()) == 4, opt.dear_groups()
        assert opt.dear_groups()[0] == ["conv.weight", "conv.bias", "norm.weight", "norm.bias"]
    torch.testing.assert_close(flat(model), flat(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_clipping(hvd, opt_name):
    ref, _, _ = train(hvd, "default", opt_name, clip=0.05)
    model, _, _ = train(hvd, "dear", opt_name, clip=0.05)
    torch.testing.assert_close(flat(model), flat(ref), rtol=1e-5, atol=1e-6)
    # Horovod's pattern (synchronize, torch's clip on .grad, skip_synchronize) works with DeAR too.
    model2, _, _ = train(hvd, "dear", opt_name, clip=0.05, torch_clip=True)
    torch.testing.assert_close(flat(model2), flat(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_accumulation(hvd, opt_name):
    ref, _, _ = train(hvd, "default", opt_name, passes=2)
    model, _, _ = train(hvd, "dear", opt_name, passes=2)
    torch.testing.assert_close(flat(model), flat(ref), rtol=1e-5, atol=1e-6)


def test_one_group_per_module_and_one_group(hvd, monkeypatch):
    ref, _, _ = train(hvd, "default", "adam")
    for threshold in ("0", str(1 << 30)):
        monkeypatch.setenv("PERSEUS_DEAR_THRESHOLD_BYTES", threshold)
        model, opt, _ = train(hvd, "dear", "adam")
        if hvd.size() > 1:
            assert len(opt.dear_groups()) == (5 if threshold == "0" else 1)
        torch.testing.assert_close(flat(model), flat(ref), rtol=1e-5, atol=1e-6)


def test_eval_between_steps_sees_updated_parameters(hvd):
    _, _, ref_seen = train(hvd, "default", "adamw", evaluate=True)
    _, _, seen = train(hvd, "dear", "adamw", evaluate=True)
    for a, b in zip(seen, ref_seen):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_updates_are_deferred_until_forward(hvd):
    torch.manual_seed(0)
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), schedule="dear")
    x, y = batch(hvd, 0)
    F.cross_entropy(model(x), y).backward()
    before = flat(model)
    opt.step()
    if hvd.size() > 1:
        assert torch.equal(flat(model), before)  # nothing applied yet
    opt.finish()
    assert not torch.equal(flat(model), before)
    opt.synchronize()  # nothing pending: a no-op


def test_state_dict_round_trip(hvd):
    ref, ref_opt, _ = train(hvd, "default", "adam", steps=2 * STEPS)
    model, opt, _ = train(hvd, "dear", "adam", steps=STEPS)
    state = copy.deepcopy(opt.state_dict())
    _, ref_half, _ = train(hvd, "default", "adam", steps=STEPS)
    for k, v in ref_half.state_dict()["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(state["state"][k][key], v[key], rtol=1e-5, atol=1e-6)
    resumed = Net()
    resumed.load_state_dict(model.state_dict())
    resumed, _, _ = train(hvd, "dear", "adam", steps=STEPS, model=resumed, start=STEPS, state=state)
    torch.testing.assert_close(flat(resumed), flat(ref), rtol=1e-5, atol=1e-6)


def test_state_dict_applies_pending_updates(hvd):
    torch.manual_seed(0)
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), schedule="dear")
    x, y = batch(hvd, 0)
    F.cross_entropy(model(x), y).backward()
    before = flat(model)
    opt.step()
    state = opt.state_dict()
    assert all("exp_avg" in s for s in state["state"].values())
    assert not torch.equal(flat(model), before)


def test_zero_grad(hvd):
    torch.manual_seed(0)
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), schedule="dear")
    x, y = batch(hvd, 0)
    F.cross_entropy(model(x), y).backward()
    if hvd.size() > 1:
        with pytest.raises(AssertionError, match="zero_grad"):
            opt.zero_grad()
    opt.step()
    opt.zero_grad()  # allowed after step(), with updates still pending
    assert all(p.grad is None for p in model.parameters())
    model(x)  # applies the pending update; .grad stays as the user left it
    assert all(p.grad is None for p in model.parameters())
    opt.synchronize()


def test_unsupported_combinations(hvd):
    model = Net()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NotImplementedError, match="schedule='default'"):
        hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), schedule="dear",
                                 compression=hvd.Compression.topk(0.01))
    with pytest.raises(NotImplementedError, match="groups"):
        hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), schedule="dear", groups=2)
    with pytest.raises(ValueError, match="schedule"):
        hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), schedule="fast")
    opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), schedule="dear")
    with pytest.raises(NotImplementedError, match="closure"):
        opt.step(lambda: 0.0)


def test_sparse_gradient_raises(hvd):
    emb = nn.Embedding(10, 4, sparse=True)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                   named_parameters=emb.named_parameters(), schedule="dear")
    loss = emb(torch.tensor([1, 2])).sum()
    if hvd.size() > 1:
        with pytest.raises(NotImplementedError, match="sparse_as_dense"):
            loss.backward()


def test_fp16_wire(hvd):
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    ref_opt = hvd.DistributedOptimizer(torch.optim.SGD(ref.parameters(), lr=0.1),
                                       named_parameters=ref.named_parameters(),
                                       compression=hvd.Compression.fp16)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=hvd.Compression.fp16,
                                   schedule="dear")
    for m, o in ((ref, ref_opt), (model, opt)):
        for step in range(2):
            o.zero_grad()
            x, y = batch(hvd, step)
            F.cross_entropy(m(x), y).backward()
            o.step()
        o.synchronize()
    torch.testing.assert_close(flat(model), flat(ref), rtol=1e-3, atol=1e-4)


class Branchy(Net):
    """A module used only on some steps (its gradient is missing on the others)."""

    def __init__(self):
        super().__init__()
        self.extra = nn.Linear(64, 64)
        self.use_extra = False

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv(x)), 2).flatten(1)
        if self.use_extra:
            x = self.extra(x)
        return self.head(F.relu(self.fc2(F.relu(self.fc1(self.norm(x))))))


def _train_custom(hvd, schedule, model, make_opt, steps, before_step=None, after_step=None):
    opt = hvd.DistributedOptimizer(make_opt(model), named_parameters=model.named_parameters(), schedule=schedule)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(steps):
        if before_step:
            before_step(model, opt, step)
        opt.zero_grad()
        x, y = batch(hvd, step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()  # between step() and the deferred update: the update keeps the step's learning rate
        if after_step:
            after_step(model, opt, step)
    opt.synchronize()
    return model


def test_lr_scheduler_and_unused_module(hvd):
    def before(model, opt, step):
        model.use_extra = step % 3 == 1

    results = []
    for schedule in ("default", "dear"):
        torch.manual_seed(0)
        results.append(_train_custom(hvd, schedule, Branchy(),
                                     lambda m: torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9), 5, before))
    torch.testing.assert_close(flat(results[1]), flat(results[0]), rtol=1e-5, atol=1e-6)


def test_regroup_during_run(hvd):
    def after(model, opt, step):
        if step == 1 and hasattr(opt, "set_dear_threshold"):
            opt.set_dear_threshold(0)

    results = []
    for schedule in ("default", "dear"):
        torch.manual_seed(0)
        results.append(_train_custom(hvd, schedule, Net(), lambda m: torch.optim.Adam(m.parameters(), lr=0.01), 4,
                                     after_step=after))
    torch.testing.assert_close(flat(results[1]), flat(results[0]), rtol=1e-5, atol=1e-6)


def test_broadcast_optimizer_state_and_process_set(hvd):
    """broadcast_optimizer_state works on a DeAR optimizer; a process set of the last ranks trains alone."""
    results = []
    for schedule in ("default", "dear"):
        torch.manual_seed(0)
        model = Net()
        opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(), schedule=schedule)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        for step in range(3):
            opt.zero_grad()
            x, y = batch(hvd, step)
            F.cross_entropy(model(x), y).backward()
            opt.step()
        opt.synchronize()
        results.append(flat(model))
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-6)
    if hvd.size() < 3:
        return
    ps = hvd.add_process_set(list(range(1, hvd.size())))
    try:
        results = []
        for schedule in ("default", "dear"):
            torch.manual_seed(0)
            model = Net()
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                           named_parameters=model.named_parameters(), schedule=schedule,
                                           process_set=ps)
            for step in range(3):
                opt.zero_grad()
                x, y = batch(hvd, step)
                F.cross_entropy(model(x), y).backward()
                opt.step()
            opt.synchronize()
            results.append(flat(model))
        torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-6)
    finally:
        hvd.remove_process_set(ps)


def test_mismatched_schedule_fails_on_every_rank(hvd):
    """Rank 0 uses DeAR, the others the default schedule: every rank raises instead of hanging."""
    if hvd.size() < 2:
        pytest.skip("needs 2 ranks")
    torch.manual_seed(0)
    model = Net()
    schedule = "dear" if hvd.rank() == 0 else "default"
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), schedule=schedule)
    x, y = batch(hvd, 0)
    # A rank whose first awaited gradient was never submitted by rank 0 (which stopped at its own error) learns
    # of the failure when rank 0 leaves; that error names rank 0 too.
    with pytest.raises((RuntimeError, hvd.HorovodInternalError), match="schedule|dtype|rank 0 shut down"):
        F.cross_entropy(model(x), y).backward()
        opt.step()
