"""SyncBatchNorm against torch.nn.BatchNorm{1,2,3}d run on the whole global batch.

Every rank builds the same global batch (same seed) and feeds SyncBatchNorm only its own rows (rank r gets
r + 2 rows unless a test says otherwise), while the plain module sees every row. Forward outputs and input
gradients are compared on this rank's rows; running statistics directly; weight and bias gradients after
summing every rank's (each rank's is the gradient of its own share of the loss).
"""

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from perseus.torch.sync_batch_norm import SyncBatchNorm

pytestmark = pytest.mark.timeout(120)

C = 3
# input kind -> (plain module class, shape after (N, C))
KINDS = {
    "2d": (torch.nn.BatchNorm1d, ()),
    "3d": (torch.nn.BatchNorm1d, (5,)),
    "4d": (torch.nn.BatchNorm2d, (4, 3)),
    "5d": (torch.nn.BatchNorm3d, (2, 3, 2)),
}
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.float64: dict(rtol=1e-9, atol=1e-10)}


def _uneven(size):
    return [r + 2 for r in range(size)]


def _rows(sizes, rank):
    lo = sum(sizes[:rank])
    return lo, lo + sizes[rank]


def _global_batch(seed, rows, tail, dtype):
    """The same (input, upstream gradient) on every rank; per-channel offsets and scales."""
    torch.manual_seed(seed)
    shape = (rows, C) + tail
    view = (1, C) + (1,) * len(tail)
    offset = torch.tensor([3.0, -1.0, 0.5], dtype=torch.float64).view(view)
    scale = torch.tensor([2.0, 0.5, 1.0], dtype=torch.float64).view(view)
    x = torch.randn(shape, dtype=torch.float64) * scale + offset
    up = torch.randn(shape, dtype=torch.float64)
    return x.to(dtype), up.to(dtype)


def _pair(kind, dtype, affine=True, track=True, momentum=0.1, seed=0, process_set=None):
    ref_cls, tail = KINDS[kind]
    kwargs = dict(eps=1e-5, momentum=momentum, affine=affine, track_running_stats=track)
    ref = ref_cls(C, **kwargs).to(dtype)
    sync = (SyncBatchNorm(C, **kwargs) if process_set is None
            else SyncBatchNorm(C, **kwargs, process_set=process_set)).to(dtype)
    if affine:
        torch.manual_seed(seed + 12345)
        w, b = torch.rand(C, dtype=dtype) + 0.5, torch.randn(C, dtype=dtype)
        with torch.no_grad():
            for m in (ref, sync):
                m.weight.copy_(w)
                m.bias.copy_(b)
    return ref, sync, tail


def _check_buffers(sync, ref, tol):
    for name in ("running_mean", "running_var"):
        a, b = getattr(sync, name), getattr(ref, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert_close(a, b, **tol)
    a, b = sync.num_batches_tracked, ref.num_batches_tracked
    assert (a is None) == (b is None)
    if a is not None:
        assert a.item() == b.item()


def _step(hvd, sync, ref, x, up, lo, hi, tol, reduce_param_grads=True):
    """One forward and backward of both modules; compare outputs and gradients."""
    xl = x[lo:hi].clone().requires_grad_()
    xf = x.clone().requires_grad_()
    out_l, out_f = sync(xl), ref(xf)
    assert out_l.shape == xl.shape and out_l.dtype == xl.dtype
    assert_close(out_l, out_f[lo:hi], **tol)
    (out_l * up[lo:hi]).sum().backward()
    (out_f * up).sum().backward()
    assert_close(xl.grad, xf.grad[lo:hi], **tol)
    if sync.weight is not None:
        for p, q in ((sync.weight, ref.weight), (sync.bias, ref.bias)):
            g = hvd.allreduce(p.grad, op=hvd.Sum) if reduce_param_grads else p.grad
            assert_close(g, q.grad, **tol)
            p.grad = q.grad = None


def _train_then_eval(hvd, kind, dtype, sizes, affine=True, track=True, momentum=0.1, steps=3, seed=0):
    rank = hvd.rank()
    lo, hi = _rows(sizes, rank)
    ref, sync, tail = _pair(kind, dtype, affine, track, momentum, seed)
    tol = TOL[dtype]
    for step in range(steps):
        x, up = _global_batch(seed * 100 + step, sum(sizes), tail, dtype)
        _step(hvd, sync, ref, x, up, lo, hi, tol)
        _check_buffers(sync, ref, tol)
    # Eval: running statistics when tracked (no communication), else global batch statistics again.
    sync.eval()
    ref.eval()
    x, up = _global_batch(seed * 100 + 99, sum(sizes), tail, dtype)
    _step(hvd, sync, ref, x, up, lo, hi, tol)
    _check_buffers(sync, ref, tol)


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
@pytest.mark.parametrize("track", [True, False], ids=["track", "notrack"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "noaffine"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_matches_batch_norm_on_global_batch(hvd, kind, dtype, affine, track, momentum):
    _train_then_eval(hvd, kind, dtype, _uneven(hvd.size()), affine, track, momentum)


@pytest.mark.parametrize("kind", list(KINDS))
def test_even_batches(hvd, kind):
    _train_then_eval(hvd, kind, torch.float32, [4] * hvd.size(), seed=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_rank_with_empty_batch_takes_part(hvd, kind, dtype):
    size = hvd.size()
    sizes = [0] + [r + 1 for r in range(1, size)] if size > 1 else [3]
    _train_then_eval(hvd, kind, dtype, sizes, seed=2)


def test_every_rank_empty(hvd):
    """A global batch with no rows: empty outputs, running statistics untouched, like torch."""
    ref, sync, _ = _pair("3d", torch.float32)
    x = torch.zeros(0, C, 5, requires_grad=True)
    out = sync(x)
    assert out.shape == x.shape
    out.sum().backward()
    assert x.grad.shape == x.shape
    ref(torch.zeros(0, C, 5))
    _check_buffers(sync, ref, TOL[torch.float32])


def test_bfloat16_input(hvd):
    """16-bit inputs: statistics in float32, float32 module parameters, output in the input's dtype."""
    sizes = _uneven(hvd.size())
    lo, hi = _rows(sizes, hvd.rank())
    ref, sync, tail = _pair("4d", torch.float32, seed=3)
    tol = dict(rtol=2e-2, atol=5e-2)
    for step in range(2):
        x, up = _global_batch(300 + step, sum(sizes), tail, torch.bfloat16)
        _step(hvd, sync, ref, x, up, lo, hi, tol)
        _check_buffers(sync, ref, dict(rtol=1e-2, atol=1e-2))


def test_eval_makes_no_collective(hvd):
    """In eval mode with running statistics only rank 0 runs the module; a collective would stall the job."""
    ref, sync, tail = _pair("4d", torch.float32, seed=4)
    with torch.no_grad():
        for m in (ref, sync):
            m.running_mean.copy_(torch.tensor([0.5, -0.25, 1.0]))
            m.running_var.copy_(torch.tensor([2.0, 0.5, 1.5]))
    sync.eval()
    ref.eval()
    if hvd.rank() == 0:
        x, _ = _global_batch(400, 3, tail, torch.float32)
        assert_close(sync(x), ref(x), **TOL[torch.float32])
    hvd.barrier()


def test_single_rank_process_set_is_local(hvd):
    """A process set of one rank normalizes only that rank's batch and makes no collective."""
    size, rank = hvd.size(), hvd.rank()
    sets = [hvd.global_process_set] if size == 1 else [hvd.add_process_set([r]) for r in range(size)]
    try:
        ps = sets[0] if size == 1 else sets[rank]
        ref, sync, tail = _pair("3d", torch.float64, process_set=ps, seed=5)
        n = rank + 2
        for step in range(2):
            x, up = _global_batch(500 + 10 * rank + step, n, tail, torch.float64)
            _step(hvd, sync, ref, x, up, 0, n, TOL[torch.float64], reduce_param_grads=False)
            _check_buffers(sync, ref, TOL[torch.float64])
    finally:
        if size > 1:
            for ps in sets:
                assert hvd.remove_process_set(ps)


def test_process_set_subset(hvd):
    """Statistics over the members of a process set only (the even ranks)."""
    size, rank = hvd.size(), hvd.rank()
    members = list(range(0, size, 2))
    ps = hvd.global_process_set if len(members) == size else hvd.add_process_set(members)
    try:
        if rank in members:
            sizes = [m + 1 for m in members]
            lo, hi = _rows(sizes, members.index(rank))
            ref, sync, tail = _pair("4d", torch.float64, process_set=ps, seed=6)
            tol = TOL[torch.float64]
            for step in range(2):
                x, up = _global_batch(600 + step, sum(sizes), tail, torch.float64)
                xl = x[lo:hi].clone().requires_grad_()
                xf = x.clone().requires_grad_()
                out_l, out_f = sync(xl), ref(xf)
                assert_close(out_l, out_f[lo:hi], **tol)
                (out_l * up[lo:hi]).sum().backward()
                (out_f * up).sum().backward()
                assert_close(xl.grad, xf.grad[lo:hi], **tol)
                for p, q in ((sync.weight, ref.weight), (sync.bias, ref.bias)):
                    assert_close(hvd.allreduce(p.grad, op=hvd.Sum, process_set=ps), q.grad, **tol)
                    p.grad = q.grad = None
                _check_buffers(sync, ref, tol)
        else:
            sync = SyncBatchNorm(C, process_set=ps)
            with pytest.raises(ValueError, match="not a member"):
                sync(torch.randn(4, C))
            sync.eval()(torch.randn(4, C))  # running statistics: no collective, so any rank may run it
    finally:
        if ps is not hvd.global_process_set:
            assert hvd.remove_process_set(ps)


class _Net(torch.nn.Module):
    def __init__(self, bn):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(2, 4, 3, padding=1)
        self.bn1 = bn(4)
        self.conv2 = torch.nn.Conv2d(4, 4, 1)
        self.bn2 = bn(4, momentum=None)
        self.conv3 = torch.nn.Conv2d(4, 4, 1)
        self.fc = torch.nn.Linear(4 * 5 * 5, 3)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.relu(self.bn2(self.conv3(x)))  # the same module twice in one step
        return self.fc(x.flatten(1))


def test_training_keeps_ranks_identical(hvd):
    """Several SGD steps with DistributedOptimizer: every rank ends with the same parameters and buffers, and
    they equal those of a plain model trained on the global batch."""
    size, rank = hvd.size(), hvd.rank()
    sizes = _uneven(size)
    lo, hi = _rows(sizes, rank)
    total = sum(sizes)
    torch.manual_seed(7)
    model = _Net(SyncBatchNorm).double()
    ref = _Net(torch.nn.BatchNorm2d).double()
    ref.load_state_dict(model.state_dict())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), op=hvd.Sum)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(4):
        torch.manual_seed(700 + step)
        x = torch.randn(total, 2, 5, 5, dtype=torch.float64) + 1.0
        y = torch.randn(total, 3, dtype=torch.float64)
        opt.zero_grad()
        # Each rank's loss is its share of the global mean, so the summed gradients are the global gradient.
        (((model(x[lo:hi]) - y[lo:hi]) ** 2).sum() / total).backward()
        opt.step()
        ref_opt.zero_grad()
        (((ref(x) - y) ** 2).sum() / total).backward()
        ref_opt.step()

    state, ref_state = model.state_dict(), ref.state_dict()
    assert state.keys() == ref_state.keys()
    for name, t in state.items():
        rows = hvd.allgather(t.detach().reshape(1, -1), name=f"sbn_identical.{name}")
        for r in range(size):
            assert torch.equal(rows[r], rows[0]), f"{name} differs between rank 0 and rank {r}"
        if t.is_floating_point():
            assert_close(t, ref_state[name], rtol=1e-7, atol=1e-9, msg=name)
        else:
            assert torch.equal(t, ref_state[name]), name


def test_single_value_per_channel_raises_on_every_rank(hvd):
    """One row in the whole global batch: every rank raises, none hangs (the others hold no rows)."""
    x = torch.randn(1 if hvd.rank() == 0 else 0, C)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        SyncBatchNorm(C)(x)


def test_one_dimensional_input_raises(hvd):
    with pytest.raises(ValueError, match="expected at least 2D input"):
        SyncBatchNorm(C)(torch.randn(C))
    with pytest.raises(ValueError, match="expected at least 2D input"):
        SyncBatchNorm(C).eval()(torch.randn(C))


def test_wrong_channel_count_raises(hvd):
    with pytest.raises(ValueError, match="channels"):
        SyncBatchNorm(C)(torch.randn(4, C + 1))


def test_non_cpu_input_raises_before_communicating(hvd):
    """The sync path needs CPU tensors; a meta-device input stands in for a GPU one. Rank 0 alone calls it: a
    collective would stall the job."""
    if hvd.size() == 1:
        pytest.skip("one rank: plain batch norm, no collective")
    if hvd.rank() == 0:
        with pytest.raises(NotImplementedError, match="CPU"):
            SyncBatchNorm(C)(torch.empty(4, C, device="meta"))
