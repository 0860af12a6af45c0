"""Broadcast, allgather, alltoall and reducescatter through the device launcher (perseus/torch/device_collectives.py)
on CPU tensors with Gloo, which is what PERSEUS_DEVICE_BACKEND=gloo does and what a GPU does with NCCL: each
request is one launch of the backend's own collective (perseus's channels carry none of its data), uneven first
dimensions and splits included, with the values of the host path."""

import pytest
import torch

import perseus.torch as hvd_module
from perseus.torch import _allreduce_ops, device, device_collectives

pytestmark = [pytest.mark.timeout(120), pytest.mark.rank_count]  # (timeout: for hangs)


@pytest.fixture
def on_launcher(hvd, monkeypatch):
    """CPU collectives through the launcher, for this test (until the next init()); the launcher's groups are
    built (their rendezvous goes through perseus's channels) before the test counts anything."""
    monkeypatch.setattr(device, "_gloo", True)
    monkeypatch.setattr(_allreduce_ops, "_plain_cpu", None)
    hvd.broadcast(torch.zeros(1), 0, name="dc.warm_up")


def launches(hvd):
    return hvd.device_stats()["launches"]


def counted(hvd, fn):
    """fn()'s value, the launcher's launches it made, and the bytes perseus's own channels sent meanwhile."""
    before, wire = launches(hvd), hvd.wire_bytes()["sent_bytes"]
    value = fn()
    return value, launches(hvd) - before, hvd.wire_bytes()["sent_bytes"] - wire


def test_broadcast_in_place_and_new(hvd, on_launcher):
    size, rank = hvd.size(), hvd.rank()
    root = size - 1
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4) * (rank + 1)
    out, n, wire = counted(hvd, lambda: hvd.broadcast(t, root_rank=root, name="dc.bc"))
    assert torch.equal(out, torch.arange(12, dtype=torch.float32).reshape(3, 4) * size)
    assert torch.equal(t, torch.arange(12, dtype=torch.float32).reshape(3, 4) * (rank + 1)), "input untouched"
    assert n == 1 and wire == 0
    flags = torch.tensor([rank % 2 == 0, True, rank == root])
    same = hvd.broadcast_(flags, root_rank=root, name="dc.bc_bool")
    assert same is flags and flags.tolist() == [root % 2 == 0, True, True]
    small = torch.full((5,), rank, dtype=torch.int8)
    assert hvd.broadcast(small, 0, name="dc.bc_int8").tolist() == [0] * 5
    # A non-contiguous source is broadcast by value.
    wide = (torch.arange(8.0).reshape(2, 4) + rank).t()
    assert torch.equal(hvd.broadcast(wide, 0, name="dc.bc_view"), torch.arange(8.0).reshape(2, 4).t())


def test_allgather_even_uneven_and_grouped(hvd, on_launcher):
    size, rank = hvd.size(), hvd.rank()
    even, n, wire = counted(hvd, lambda: hvd.allgather(torch.full((2, 3), float(rank)), name="dc.ag_even"))
    assert torch.equal(even, torch.cat([torch.full((2, 3), float(r)) for r in range(size)]))
    assert n == 1 and wire == 0
    # Rank r gives r + 1 rows (rank 0 none when shifted): uneven first dimensions, an empty contribution.
    for shift in (0, 1):
        rows = rank + 1 - shift
        t = torch.arange(rows * 2, dtype=torch.int64).reshape(rows, 2) + 100 * rank
        out = hvd.allgather(t, name=f"dc.ag_uneven.{shift}")
        expected = torch.cat([torch.arange((r + 1 - shift) * 2, dtype=torch.int64).reshape(-1, 2) + 100 * r
                              for r in range(size)])
        assert torch.equal(out, expected), (shift, out)
    scalar = hvd.allgather(torch.tensor(float(rank)), name="dc.ag_scalar")
    assert scalar.tolist() == [float(r) for r in range(size)]
    outs, n, _ = counted(hvd, lambda: hvd.grouped_allgather(
        [torch.full((rank + 1,), rank, dtype=torch.int32), torch.ones(1, 2, dtype=torch.float64)],
        name="dc.ag_group"))
    assert outs[0].tolist() == sum([[r] * (r + 1) for r in range(size)], [])
    assert outs[1].shape == (size, 2) and outs[1].dtype == torch.float64
    assert n == 2  # one launch per request


def test_allgather_gradient(hvd, on_launcher):
    rank = hvd.rank()
    x = torch.full((rank + 1, 2), 1.0, requires_grad=True)
    out = hvd.allgather(x, name="dc.ag_grad")
    (out * 3).sum().backward()
    assert torch.allclose(x.grad, torch.full((rank + 1, 2), 3.0))


def test_alltoall_with_splits(hvd, on_launcher):
    size, rank = hvd.size(), hvd.rank()
    # Rank r sends (r + d) % 3 rows to rank d (some zero), each row tagged with sender and receiver.
    splits = [(rank + d) % 3 for d in range(size)]
    rows = torch.cat([torch.tensor([[rank, d]] * c, dtype=torch.float32).reshape(c, 2)
                      for d, c in enumerate(splits)])
    (out, received), n, wire = counted(hvd, lambda: hvd.alltoall(rows, splits=torch.tensor(splits), name="dc.a2a"))
    assert received.tolist() == [(s + rank) % 3 for s in range(size)]
    expected = torch.cat([torch.tensor([[s, rank]] * ((s + rank) % 3), dtype=torch.float32).reshape(-1, 2)
                          for s in range(size)])
    assert torch.equal(out, expected)
    assert n == 1 and wire == 0
    even = hvd.alltoall(torch.arange(size * 2.0) + 10 * rank, name="dc.a2a_even")
    assert even.tolist() == sum([[10.0 * s + 2 * rank, 10.0 * s + 2 * rank + 1] for s in range(size)], [])
    # Rank 0 receives nothing at all (every rank sends it 0 rows).
    give = [0] + [1] * (size - 1)
    got, received = hvd.alltoall(torch.ones(size - 1, 3), splits=give, name="dc.a2a_none")
    assert received.tolist() == ([0] * size if rank == 0 else [1] * size)
    assert got.shape == ((0, 3) if rank == 0 else (size, 3))
    with pytest.raises(ValueError, match="splits"):
        hvd.alltoall(rows, splits=[1] * (size + 1), name="dc.a2a_bad")


def test_reducescatter_ops_scales_and_uneven_rows(hvd, on_launcher):
    size, rank = hvd.size(), hvd.rank()
    for rows in (size * 2, size * 2 + 1, 1):  # even, uneven, fewer rows than ranks
        t = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) * (rank + 1)
        total = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) * (size * (size + 1) / 2)
        counts = [rows // size + (1 if r < rows % size else 0) for r in range(size)]
        start = sum(counts[:rank])
        mine = total[start:start + counts[rank]]
        out, n, wire = counted(hvd, lambda: hvd.reducescatter(t, op=hvd.Sum, name=f"dc.rs.{rows}"))
        assert out.shape == mine.shape and torch.allclose(out, mine), (rows, out, mine)
        assert n == 1 and wire == 0
        avg = hvd.reducescatter(t, name=f"dc.rs_avg.{rows}", prescale_factor=2.0, postscale_factor=0.5)
        assert torch.allclose(avg, mine / size)
        top = hvd.reducescatter(t, op=hvd.Max, name=f"dc.rs_max.{rows}")
        assert torch.allclose(top, (total / (size * (size + 1) / 2) * size)[start:start + counts[rank]])
    ints = hvd.reducescatter(torch.full((size, 2), rank + 1, dtype=torch.int64), op=hvd.Sum, name="dc.rs_int")
    assert ints.tolist() == [[size * (size + 1) // 2] * 2]
    outs = hvd.grouped_reducescatter([torch.ones(size, 2), torch.ones(size * 3)], op=hvd.Sum, name="dc.rs_group")
    assert [o.tolist() for o in outs] == [[[float(size)] * 2], [float(size)] * 3]


def test_what_the_backends_cannot_move_is_not_launched(hvd, on_launcher):
    size = hvd.size()
    # int16 (neither NCCL nor Gloo moves it) and an integer Average take the host path, with the same results.
    before = launches(hvd)
    assert hvd.allgather(torch.ones(2, dtype=torch.int16), name="dc.ag_i16").tolist() == [1] * (2 * size)
    assert hvd.reducescatter(torch.ones(size, dtype=torch.int32) * 4, name="dc.rs_iavg").tolist() == [4]
    assert launches(hvd) == before
    assert not device_collectives.takes([torch.ones(2, dtype=torch.int16)], device_collectives.BROADCAST)


def test_a_mismatch_fails_on_every_rank_naming_the_tensor(hvd, on_launcher):
    rank = hvd.rank()
    t = torch.ones(2, 3 + (rank > 0))  # the ranks disagree on the second dimension
    with pytest.raises(hvd_module.HorovodInternalError, match="dc.ag_mismatch"):
        hvd.allgather(t, name="dc.ag_mismatch")
    # Nothing of the failed request is left behind, and the name can be used again.
    assert not [k for k in device._launcher._entries if "dc.ag_mismatch" in k[1]]
    out = hvd.allgather(torch.ones(2, 3), name="dc.ag_mismatch")
    assert out.shape == (2 * hvd.size(), 3)


def test_dear_reduce_scatter_and_all_gather_on_the_launcher(hvd, on_launcher, monkeypatch):
    """DeAR's groups live where the launcher moves them (the GPU with NCCL; here host memory with Gloo): each
    step's reduce-scatters and all-gathers are launches, one per group each, and training equals the default
    schedule's."""
    import torch.nn as nn

    monkeypatch.setenv("PERSEUS_DEAR_THRESHOLD_BYTES", "4096")  # several groups
    steps = 4

    def run(schedule, tag):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=[(f"{tag}.{n}", p) for n, p in model.named_parameters()],
                                       schedule=schedule)
        g = torch.Generator().manual_seed(10 + hvd.rank())
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(8, 16, generator=g)).square().mean().backward()
            opt.step()
        opt.synchronize()  # (DeAR: the last step's deferred updates)
        return torch.cat([p.detach().flatten() for p in model.parameters()]), opt

    (dear, opt), n, _ = counted(hvd, lambda: run("dear", "dc.dear"))
    groups = opt._schedule.groups
    assert len(groups) > 1 and all(g.launcher for g in groups)
    assert n >= 2 * steps * len(groups), (n, len(groups))
    reference, _ = run("default", "dc.dear.ref")
    torch.testing.assert_close(dear, reference, rtol=1e-5, atol=1e-6)
