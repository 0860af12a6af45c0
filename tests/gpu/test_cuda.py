"""CUDA tensors through perseus.torch: ordering with the caller's streams, the build flags, the converter's
device pinning. Host staging itself is tested on every collective by tests/mpi/test_staging.py, which also
runs its cases on CUDA tensors when a GPU is present."""

import pytest
import torch

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU; tools/gpu_check.sh runs these on a GPU machine")]


def _busy_then_fill(t, value, stream=None):
    """Queue a few hundred milliseconds of matrix work, then write ``value`` into ``t``, on ``stream``."""
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        a = torch.randn(4096, 4096, device="cuda")
        for _ in range(40):
            a = a @ a
            a = a / a.norm()
        t.copy_(torch.full_like(t, value) + 0 * a[0, 0])


def test_build_flags(hvd):
    assert hvd.cuda_built() and hvd.mpi_ops.cuda_built()
    assert hvd._check_has_gpu()
    assert not hvd.nccl_built()  # no NCCL transport: what is said must be true


def test_producer_still_running_at_submit(hvd):
    """The allreduce is submitted while the kernels producing its input are still queued: it must see their
    result, not the tensor's earlier contents."""
    t = torch.zeros(1 << 20, device="cuda")
    _busy_then_fill(t, float(hvd.rank() + 1))
    out = hvd.allreduce(t, op=hvd.Sum, name="gpu.producer")
    expected = sum(range(1, hvd.size() + 1))
    assert torch.all(out == expected).item()


def test_producer_on_a_side_stream(hvd):
    """Work and the call on a stream of the user's own: staging orders itself after that stream."""
    side = torch.cuda.Stream()
    t = torch.zeros(4096, device="cuda")
    with torch.cuda.stream(side):
        _busy_then_fill(t, 2.0, side)
        handle = hvd.allreduce_async_(t, op=hvd.Sum, name="gpu.side")
        hvd.synchronize(handle)
        total = t.sum()  # queued on side after the copy back
    side.synchronize()
    assert total.item() == 2.0 * hvd.size() * 4096


def test_result_ordered_before_later_kernels(hvd):
    """After synchronize, kernels queued on the caller's stream see the result without a host wait."""
    for i in range(20):
        t = torch.full((1 << 18,), float(i), device="cuda")
        out = hvd.allreduce(t, name=f"gpu.order.{i}")
        assert out.mean().item() == float(i)


def test_many_steps_reuse_pinned_buffers(hvd):
    """Staging buffers come from torch's pinned host cache: 50 steps of the same sizes add no new blocks."""
    grads = [torch.randn(n, device="cuda") for n in (1000, 1 << 16, 1 << 20)]
    for step in range(50):
        for i, g in enumerate(grads):
            hvd.allreduce_(g, name=f"gpu.steps.{i}")
        if step == 5:
            stats = getattr(torch.cuda, "host_memory_stats", None)
            key = "num_host_alloc" if stats and "num_host_alloc" in stats() else "allocations.allocated"
            before = stats()[key] if stats else None
    if stats:
        assert stats()[key] == before, stats()


def test_dear_and_adasum_stage_too(hvd):
    """The schedules that stage first: DeAR's host buffers and Adasum; a CUDA step runs and agrees across ranks."""
    for kw in ({"schedule": "dear"}, {"op": hvd.Adasum}):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).cuda()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=[(f"{list(kw)[0]}.{n}", p)
                                                         for n, p in model.named_parameters()], **kw)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        for step in range(2):
            x = torch.randn(8, 16, device="cuda") + hvd.rank()
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        gathered = hvd.allgather(flat.unsqueeze(0), name=f"gpu.{list(kw)[0]}.same")
        assert all(torch.equal(gathered[r], gathered[0]) for r in range(hvd.size()))
