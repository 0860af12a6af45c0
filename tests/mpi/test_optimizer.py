"""DistributedOptimizer and the broadcast helpers: distributed training equals training on the global batch."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytestmark = pytest.mark.timeout(120)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.fc1 = nn.Linear(4 * 4 * 4, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def global_batch(step, size, per_rank=4):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(size * per_rank, 1, 8, 8, generator=g)
    y = torch.randint(0, 3, (size * per_rank,), generator=g)
    return x, y


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def assert_same_on_all_ranks(hvd, tensor, name):
    gathered = hvd.allgather(tensor.unsqueeze(0), name=name)
    for r in range(hvd.size()):
        torch.testing.assert_close(gathered[r], gathered[0], rtol=0, atol=0)


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01),
}


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_matches_single_process_on_global_batch(hvd, opt_name):
    size, rank = hvd.size(), hvd.rank()
    torch.manual_seed(0)
    reference = Net()
    model = copy.deepcopy(reference)
    ref_opt = OPTIMIZERS[opt_name](reference.parameters())
    opt = hvd.DistributedOptimizer(OPTIMIZERS[opt_name](model.parameters()),
                                   named_parameters=model.named_parameters())
    assert type(opt).__name__ == type(ref_opt).__name__
    assert isinstance(opt, type(ref_opt))
    for step in range(4):
        x, y = global_batch(step, size)
        ref_opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
        lo, hi = rank * 4, (rank + 1) * 4
        opt.zero_grad()
        F.cross_entropy(model(x[lo:hi]), y[lo:hi]).backward()
        opt.step()
        torch.testing.assert_close(flat(model), flat(reference), rtol=1e-4, atol=1e-6)
        assert_same_on_all_ranks(hvd, flat(model), f"same.{opt_name}.{step}")


def test_backward_passes_per_step_accumulates_locally(hvd):
    size, rank = hvd.size(), hvd.rank()
    torch.manual_seed(1)
    reference = Net()
    model = copy.deepcopy(reference)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), backward_passes_per_step=2)
    for step in range(2):
        ref_opt.zero_grad()
        opt.zero_grad()
        for micro in range(2):
            x, y = global_batch(10 * step + micro, size)
            # reference: the average over ranks of each rank's summed micro-batch gradients
            F.cross_entropy(reference(x), y).backward()
            lo, hi = rank * 4, (rank + 1) * 4
            F.cross_entropy(model(x[lo:hi]), y[lo:hi]).backward()
        ref_opt.step()
        opt.step()
        torch.testing.assert_close(flat(model), flat(reference), rtol=1e-4, atol=1e-6)
    # a third backward before step() is an error, as in Horovod
    x, y = global_batch(99, size)
    opt.zero_grad()
    for _ in range(2):
        F.cross_entropy(model(x), y).backward()
    with pytest.raises(AssertionError, match="backward_passes_per_step"):
        F.cross_entropy(model(x), y).backward()
    opt.synchronize()


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_compression_is_close_to_uncompressed(hvd, compression):
    size, rank = hvd.size(), hvd.rank()
    torch.manual_seed(2)
    plain = Net()
    squeezed = copy.deepcopy(plain)
    opt_a = hvd.DistributedOptimizer(torch.optim.SGD(plain.parameters(), lr=0.1),
                                     named_parameters=[(f"a.{n}", p) for n, p in plain.named_parameters()])
    opt_b = hvd.DistributedOptimizer(torch.optim.SGD(squeezed.parameters(), lr=0.1),
                                     named_parameters=[(f"b.{n}", p) for n, p in squeezed.named_parameters()],
                                     compression=getattr(hvd.Compression, compression))
    x, y = global_batch(3, size)
    lo, hi = rank * 4, (rank + 1) * 4
    for model, opt in ((plain, opt_a), (squeezed, opt_b)):
        opt.zero_grad()
        F.cross_entropy(model(x[lo:hi]), y[lo:hi]).backward()
        opt.step()
    tol = 1e-3 if compression == "fp16" else 1e-2
    torch.testing.assert_close(flat(squeezed), flat(plain), rtol=tol, atol=tol)
    for p in squeezed.parameters():
        assert p.grad.dtype == torch.float32


@pytest.mark.parametrize("groups", [2, "list"])
def test_grouped_reduction_matches_ungrouped(hvd, groups):
    size, rank = hvd.size(), hvd.rank()
    torch.manual_seed(3)
    a = Net()
    b = copy.deepcopy(a)
    opt_a = hvd.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.1),
                                     named_parameters=[(f"ga.{n}", p) for n, p in a.named_parameters()])
    groups_arg = 2 if groups == 2 else [[b.fc1.weight, b.fc2.weight], [b.conv.bias]]
    opt_b = hvd.DistributedOptimizer(torch.optim.SGD(b.parameters(), lr=0.1),
                                     named_parameters=[(f"gb.{n}", p) for n, p in b.named_parameters()],
                                     groups=groups_arg)
    x, y = global_batch(4, size)
    lo, hi = rank * 4, (rank + 1) * 4
    for model, opt in ((a, opt_a), (b, opt_b)):
        opt.zero_grad()
        F.cross_entropy(model(x[lo:hi]), y[lo:hi]).backward()
        opt.step()
    torch.testing.assert_close(flat(b), flat(a), rtol=1e-5, atol=1e-7)


def test_frozen_and_unused_parameters_do_not_hang(hvd):
    size, rank = hvd.size(), hvd.rank()

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.frozen = nn.Linear(4, 4)
            self.frozen.requires_grad_(False)
            self.a = nn.Linear(4, 1)
            self.b = nn.Linear(4, 1)

        def forward(self, x, use_b):
            h = self.frozen(x)
            return self.b(h) if use_b else self.a(h)

    torch.manual_seed(4)
    model = Branchy()
    frozen_before = model.frozen.weight.detach().clone()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x = torch.ones(2, 4)
    opt.zero_grad()
    model(x, use_b=(rank == 0)).sum().backward()  # rank 0 uses b only, others a only
    opt.step()
    assert torch.equal(model.frozen.weight, frozen_before)
    assert_same_on_all_ranks(hvd, flat(model), "branchy")
    if size > 1:  # b's gradient exists only on rank 0: averaged with the zeros of the other ranks
        expected = torch.ones(1) * 2.0 / size
        torch.testing.assert_close(model.b.bias.grad, expected)


def test_zero_grad_before_step_is_an_error(hvd):
    model = nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=[(f"zg.{n}", p) for n, p in model.named_parameters()])
    model(torch.ones(1, 3)).sum().backward()
    if hvd.size() > 1:
        with pytest.raises(AssertionError, match="zero_grad"):
            opt.zero_grad()
    opt.step()
    opt.zero_grad()


def test_synchronize_then_skip_synchronize(hvd):
    model = nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=[(f"ss.{n}", p) for n, p in model.named_parameters()])
    model(torch.ones(1, 3) * (hvd.rank() + 1)).sum().backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with opt.skip_synchronize():
        opt.step()
    assert_same_on_all_ranks(hvd, flat(model), "skipsync")


def test_named_parameters_validation(hvd):
    model = nn.Linear(3, 1)
    with pytest.raises(ValueError, match="tuples"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=list(model.parameters()))
    with pytest.raises(ValueError, match="unique"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=[("x", model.weight), ("x", model.bias)])
    with pytest.raises(ValueError, match="not named"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=[("w", model.weight)])
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), backward_passes_per_step=0)


@pytest.mark.parametrize("opt_name", ["sgd", "adam", "adamw", "rmsprop", "adagrad"])
def test_broadcast_optimizer_state(hvd, opt_name):
    rank = hvd.rank()
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1 * (rank + 1), momentum=0.9, weight_decay=0.01),
            "adam": lambda p: torch.optim.Adam(p, lr=0.01 * (rank + 1)),
            "adamw": lambda p: torch.optim.AdamW(p, lr=0.01 * (rank + 1)),
            "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01 * (rank + 1), momentum=0.5),
            "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.01 * (rank + 1))}[opt_name]
    torch.manual_seed(rank)  # every rank starts different
    model = Net()
    opt = make(model.parameters())
    if rank == 0:  # only the root has trained: its state exists, the others' does not yet
        F.cross_entropy(model(torch.randn(2, 1, 8, 8)), torch.tensor([0, 1])).backward()
        opt.step()
    before = flat(model).clone()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    if rank != 0:
        assert not torch.equal(before, flat(model)) or hvd.size() == 1
    assert_same_on_all_ranks(hvd, flat(model), f"bos.params.{opt_name}")
    lrs = hvd.allgather_object(opt.param_groups[0]["lr"], name=f"bos.lr.{opt_name}")
    assert len(set(lrs)) == 1
    for i, p in enumerate(model.parameters()):
        for key, value in sorted(opt.state[p].items()):
            v = value if torch.is_tensor(value) else torch.tensor(float(value))
            assert_same_on_all_ranks(hvd, v.flatten().double(), f"bos.{opt_name}.{key}.{i}")


def test_broadcast_optimizer_state_rejects_lbfgs(hvd):
    model = nn.Linear(2, 1)
    with pytest.raises(ValueError, match="LBFGS"):
        hvd.broadcast_optimizer_state(torch.optim.LBFGS(model.parameters()), root_rank=0)


def test_broadcast_and_allgather_object(hvd):
    size, rank = hvd.size(), hvd.rank()
    obj = {"rank": rank, "payload": list(range(rank * 100))}
    got = hvd.broadcast_object(obj, root_rank=size - 1, name="bobj")
    assert got == {"rank": size - 1, "payload": list(range((size - 1) * 100))}
    everyone = hvd.allgather_object(obj, name="agobj")
    assert everyone == [{"rank": r, "payload": list(range(r * 100))} for r in range(size)]
    assert hvd.broadcast_object(None, root_rank=0, name="bnone") is None


# -- step(closure): L-BFGS and other optimizers that evaluate the loss themselves ----------------------------

def _closure(model, opt, x, y, counter):
    def closure():
        counter.append(1)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss
    return closure


@pytest.mark.parametrize("line_search", [None, "strong_wolfe"])
def test_lbfgs_closure_matches_single_process_on_global_batch(hvd, line_search):
    size, rank = hvd.size(), hvd.rank()
    torch.manual_seed(6)
    reference = Net().double()
    model = copy.deepcopy(reference)
    make = lambda p: torch.optim.LBFGS(p, lr=0.5, max_iter=6, history_size=4,  # noqa: E731
                                       line_search_fn=line_search)
    ref_opt = make(reference.parameters())
    opt = hvd.DistributedOptimizer(make(model.parameters()),
                                   named_parameters=[(f"lbfgs.{n}", p) for n, p in model.named_parameters()])
    for step in range(3):
        x, y = global_batch(step, size)
        x = x.double()
        ref_evals, evals = [], []
        ref_loss = ref_opt.step(_closure(reference, ref_opt, x, y, ref_evals))
        lo, hi = rank * 4, (rank + 1) * 4
        loss = opt.step(_closure(model, opt, x[lo:hi], y[lo:hi], evals))
        # the returned loss is the first evaluation's, averaged over the ranks: the global batch's loss
        torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
        assert loss.dtype == torch.float64 and not loss.requires_grad
        assert len(evals) == len(ref_evals) > 1, (len(evals), len(ref_evals))
        assert hvd.allgather_object(len(evals), name=f"lbfgs.evals.{line_search}.{step}") == [len(evals)] * size
        torch.testing.assert_close(flat(model), flat(reference), rtol=1e-8, atol=1e-10)
        assert_same_on_all_ranks(hvd, flat(model), f"lbfgs.same.{line_search}.{step}")
    assert opt.state[opt._params[0]]["func_evals"] == ref_opt.state[ref_opt._params[0]]["func_evals"]


def test_sgd_closure_matches_single_process_on_global_batch(hvd):
    size, rank = hvd.size(), hvd.rank()
    torch.manual_seed(7)
    reference = Net()
    model = copy.deepcopy(reference)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=[(f"sgdc.{n}", p) for n, p in model.named_parameters()])
    for step in range(4):
        x, y = global_batch(step, size)
        ref_evals, evals = [], []
        ref_loss = ref_opt.step(_closure(reference, ref_opt, x, y, ref_evals))
        lo, hi = rank * 4, (rank + 1) * 4
        loss = opt.step(_closure(model, opt, x[lo:hi], y[lo:hi], evals))
        assert len(evals) == len(ref_evals) == 1
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(flat(model), flat(reference), rtol=1e-4, atol=1e-6)
        assert_same_on_all_ranks(hvd, flat(model), f"sgdc.same.{step}")
    # the usual loop (backward, then step without a closure) still works on the same optimizer
    x, y = global_batch(9, size)
    opt.zero_grad()
    F.cross_entropy(model(x[rank * 4:(rank + 1) * 4]), y[rank * 4:(rank + 1) * 4]).backward()
    opt.step()
    assert_same_on_all_ranks(hvd, flat(model), "sgdc.after")


def test_closure_returning_a_float_or_none(hvd):
    rank = hvd.rank()
    model = nn.Linear(3, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=[(f"cf.{n}", p) for n, p in model.named_parameters()])

    def closure_float():
        opt.zero_grad()
        loss = model(torch.ones(1, 3) * (rank + 1)).sum()
        loss.backward()
        return float(rank)

    def closure_none():
        opt.zero_grad()
        model(torch.ones(1, 3)).sum().backward()

    got = opt.step(closure_float)
    assert isinstance(got, float) and got == pytest.approx((hvd.size() - 1) / 2)
    assert opt.step(closure_none) is None
    assert_same_on_all_ranks(hvd, flat(model), "closure.float")
    with pytest.raises(TypeError, match="closure returned a str"):
        opt.step(lambda: "loss")


def test_diverging_closure_evaluations_raise_on_every_rank(hvd):
    size, rank = hvd.size(), hvd.rank()
    if size == 1:
        pytest.skip("needs several ranks")

    class Uneven(torch.optim.SGD):  # evaluates the closure rank + 1 times: the ranks disagree
        def step(self, closure=None):
            loss = None
            for _ in range(rank + 1):
                loss = closure()
            return loss

    model = nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(Uneven(model.parameters(), lr=0.1),
                                   named_parameters=[(f"uneven.{n}", p) for n, p in model.named_parameters()])

    def closure():
        opt.zero_grad()
        loss = model(torch.ones(2, 3)).sum()
        loss.backward()
        return loss

    with pytest.raises(RuntimeError, match="diverged"):
        opt.step(closure)
    # every rank raised at the same rendezvous: the job can still communicate
    assert hvd.allgather_object(rank, name="uneven.after") == list(range(size))


def _counting_subclass(base):
    """A user's subclass of a DistributedOptimizer class whose overrides reach it through super()."""
    class Counting(base):
        def step(self, closure=None):
            self.steps = getattr(self, "steps", 0) + 1
            return super().step(closure)

        def synchronize(self):
            self.syncs = getattr(self, "syncs", 0) + 1
            super().synchronize()

        def zero_grad(self, set_to_none=True):
            return super().zero_grad(set_to_none=set_to_none)

        def state_dict(self):
            return super().state_dict()

    return Counting


@pytest.mark.parametrize("kind", ["default", "dear", "adasum"])
def test_returned_class_can_be_subclassed(hvd, kind):
    """Subclassing type(opt), built directly or put on an existing optimizer, trains like the
    optimizer DistributedOptimizer returned (its methods reach the wrapped class through super())."""
    size, rank = hvd.size(), hvd.rank()
    schedule = {"schedule": "dear"} if kind == "dear" else {}
    op = {"op": hvd.Adasum} if kind == "adasum" else {}
    torch.manual_seed(3)
    models = [Net() for _ in range(3)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())

    def names(tag, model):
        return [(f"sub.{kind}.{tag}.{n}", p) for n, p in model.named_parameters()]

    plain = hvd.DistributedOptimizer(torch.optim.SGD(models[0].parameters(), lr=0.1, momentum=0.9),
                                     named_parameters=names("plain", models[0]), **schedule, **op)
    sub_cls = _counting_subclass(type(plain))
    built = sub_cls([{"params": list(models[1].parameters()), "lr": 0.1, "momentum": 0.9}],
                    named_parameters=names("built", models[1]), **op)
    moved = hvd.DistributedOptimizer(torch.optim.SGD(models[2].parameters(), lr=0.1, momentum=0.9),
                                     named_parameters=names("moved", models[2]), **schedule, **op)
    moved.__class__ = _counting_subclass(type(moved))
    for opt in (built, moved):
        assert isinstance(opt, type(plain).__mro__[1]) and isinstance(opt, torch.optim.SGD)
        assert hasattr(opt, "dear_groups") == (kind == "dear")
    for step in range(3):
        x, y = global_batch(step, size)
        for model, opt in zip(models, (plain, built, moved)):
            opt.zero_grad()
            F.cross_entropy(model(x[rank * 4:(rank + 1) * 4]), y[rank * 4:(rank + 1) * 4]).backward()
            opt.step()
    for opt in (plain, built, moved):
        opt.synchronize()  # DeAR: the last deferred update
        assert opt.state_dict()["param_groups"][0]["lr"] == 0.1
    for model, opt in zip(models[1:], (built, moved)):
        assert opt.steps == 3
        if kind != "dear" and size > 1:  # step() synchronizes through the (overridden) method
            assert opt.syncs == 4
        # (not bit-exact: the three optimizers' tensors are fused differently, so at 3 ranks and more the
        # reductions may add in another order)
        torch.testing.assert_close(flat(model), flat(models[0]), rtol=1e-5, atol=1e-6)
