"""Device buckets (native/device_buckets.h) through the launcher on CPU tensors (Gloo, what
PERSEUS_DEVICE_BACKEND=gloo does): learned from the first step, one launch per bucket afterwards, the first
bucket launched while the backward pass still runs, and programs whose order differs from the plan (a wait
before the rest is submitted, a new order) finish with the right values instead of waiting for ever."""

import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from perseus.torch import _allreduce_ops, device

pytestmark = pytest.mark.timeout(180)  # for hangs


def _route_cpu(monkeypatch):
    """CPU all-reduces through the launcher, for this test (until the next init())."""
    monkeypatch.setattr(device, "_gloo", True)
    monkeypatch.setattr(_allreduce_ops, "_plain_cpu", None)  # read again


@pytest.fixture
def launcher_on_cpu(monkeypatch):
    _route_cpu(monkeypatch)


def mlp(width=256, depth=24):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(nn.Linear(32, width), *layers, nn.Linear(width, 10))


def ddp_style_buckets(model, first=1 << 20, rest=25 << 20):
    """How many buckets the gradients make when grouped in backward order (last layer first), a bucket closing
    once it holds ``first`` bytes (the first) or ``rest`` (the others), as torch DDP groups them after its first
    iteration."""
    sizes = [p.numel() * p.element_size() for p in reversed(list(model.parameters()))]
    count, filled, cap = 0, 0, first
    for s in sizes:
        filled += s
        if filled >= cap:
            count, filled, cap = count + 1, 0, rest
    return count + (filled > 0)


def optimizer(hvd, model, prefix):
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                    named_parameters=[(f"{prefix}.{n}", p) for n, p in model.named_parameters()])


def train(hvd, model, steps, prefix, slow_input_s=0.0, opt=None):
    """``steps`` SGD steps on rank-dependent data (with ``opt``, or a new DistributedOptimizer); returns the
    launches of each step."""
    opt = opt or optimizer(hvd, model, prefix)
    g = torch.Generator().manual_seed(10 + hvd.rank())
    launches = []
    for _ in range(steps):
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        before = hvd.device_stats()["launches"]
        opt.zero_grad()
        if slow_input_s:  # the first layer's gradients come slow_input_s after all the others
            out = model[1:](_Slow.apply(model[0](x), slow_input_s))
        else:
            out = model(x)
        F.cross_entropy(out, y).backward()
        opt.step()
        launches.append(hvd.device_stats()["launches"] - before)
    return launches


class _Slow(torch.autograd.Function):
    """Identity whose backward sleeps (placed after the first layer, whose gradients then come late)."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


def same_everywhere(hvd, model):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(flat.unsqueeze(0), name="buckets.check")
    return all(torch.equal(gathered[0], gathered[r]) for r in range(hvd.size()))


def test_one_launch_per_bucket_after_the_first_step(hvd, launcher_on_cpu):
    model = mlp()
    launches = train(hvd, model, 8, "bk.mlp")
    expected = ddp_style_buckets(model)
    assert expected == 2
    # The first step is learned from (one launch per negotiation round); every later step launches one unit per
    # bucket, the same on every rank.
    assert launches[2:] == [expected] * 6, launches
    assert same_everywhere(hvd, model)

    # The same training through perseus's CPU channels (no launcher) gives the same parameters.
    device._gloo = False
    _allreduce_ops._plain_cpu = None
    reference = mlp()
    train(hvd, reference, 8, "bk.ref")
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6)


def test_the_first_bucket_launches_before_the_backward_pass_ends(hvd, launcher_on_cpu, monkeypatch):
    launched = []
    real = device._Launcher._launch

    def record(self, *args):
        launched.append(time.monotonic())
        return real(self, *args)

    monkeypatch.setattr(device._Launcher, "_launch", record)
    model = mlp()
    opt = optimizer(hvd, model, "bk.early")
    train(hvd, model, 3, "bk.early", opt=opt)
    ends = []

    def mark_end(grad):  # the first layer's weight: its gradient is the last of the pass
        ends.append(time.monotonic())
    model[0].weight.register_hook(mark_end)
    del launched[:]
    # The first layer's gradients come 2 s after every other gradient is out: the first bucket (the last layers'
    # gradients) must have been launched by then, on any machine.
    starts = time.monotonic()
    train(hvd, model, 1, "bk.early", slow_input_s=2.0, opt=opt)
    assert launched and ends, (launched, ends)
    assert starts < launched[0] < ends[0], (launched[0] - starts, ends[0] - starts)


def test_a_wait_before_the_rest_is_submitted_flushes_the_bucket(hvd, launcher_on_cpu):
    """Learned: a, b, c in one bucket. Then a program waits for a before it submits b and c (on one rank, or on
    all): the bucket cannot fill, so it is flushed and split; values are right and nothing hangs."""
    size, rank = hvd.size(), hvd.rank()
    ts = {n: torch.zeros(100) for n in "abc"}

    def submit(n, step):
        ts[n].fill_(rank + step)
        return hvd.allreduce_async_(ts[n], op=hvd.Sum, name=f"bk.order.{n}")

    def expect(step):
        return sum(r + step for r in range(size))

    for step in range(3):  # learn: a, b, c together
        handles = [submit(n, step) for n in "abc"]
        for h in handles:
            hvd.synchronize(h)
    for step in range(3, 6):
        # Rank 0 (step 3) or every rank (steps 4, 5) waits for a before submitting b and c.
        waits_first = rank == 0 or step > 3
        h = submit("a", step)
        if waits_first:
            hvd.synchronize(h)
            assert torch.all(ts["a"] == expect(step))
        rest = [submit(n, step) for n in "bc"]
        for x in rest + ([] if waits_first else [h]):
            hvd.synchronize(x)
        assert all(torch.all(ts[n] == expect(step)) for n in "abc")
    # A new order works as well: c first, then b, then a, each waited for at once.
    for step in range(6, 8):
        for n in "cba":
            hvd.synchronize(submit(n, step))
            assert torch.all(ts[n] == expect(step))


def test_no_buckets_when_the_budget_is_zero(hvd, monkeypatch):
    from job_env import restart

    old = restart(hvd, {"PERSEUS_DEVICE_BUCKET_BYTES": "0"})
    try:
        _route_cpu(monkeypatch)  # (init() forgot the routing)
        assert hvd.mpi_ops._runtime.engine.params(0)[6] == 0
        model = mlp(depth=4)
        launches = train(hvd, model, 4, "bk.off")
        assert all(n >= 1 for n in launches) and same_everywhere(hvd, model)
    finally:
        restart(hvd, old)


def test_timeline_marks_every_tensor_of_a_launch(hvd, launcher_on_cpu, tmp_path):
    """One record per launch names all of its tensors: each gradient's row shows its DEVICE_LAUNCH."""
    import json

    # (24 layers: two buckets whatever the order within a negotiation round; with a model near the 1 MiB of the
    # first bucket, gradients negotiated in one round could fall into one bucket or two)
    model = mlp()
    opt = optimizer(hvd, model, "bk.timeline")
    train(hvd, model, 3, "bk.timeline", opt=opt)
    path = hvd.broadcast_object(str(tmp_path / "timeline.json"))
    hvd.start_timeline(path)
    launches = train(hvd, model, 2, "bk.timeline", opt=opt)
    time.sleep(0.1)  # the engine's events are polled every 20 ms
    hvd.stop_timeline()
    assert launches == [ddp_style_buckets(model)] * 2, launches
    if hvd.rank() == 0:
        with open(path) as f:
            events = json.load(f)
        marks = [e for e in events if e.get("ph") == "B" and e.get("name") == "DEVICE_LAUNCH"]
        assert len(marks) == 2 * len(list(model.parameters())), len(marks)
