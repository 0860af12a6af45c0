"""CUDA tensors through perseus.torch: the NCCL launcher (all-reduce, broadcast, allgather, alltoall,
reducescatter) and host staging (the rest), stream-ordered completion, ordering with the callers' streams,
several NCCL channels, the build flags. Host staging itself is tested on
every collective by tests/mpi/test_staging.py, which also runs its cases on CUDA tensors when a GPU is present."""

import pytest
import torch

from perseus.torch import device

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU; tools/gpu_check.sh runs these on a GPU machine")]


def _busy_then_fill(t, value, stream=None, iterations=40):
    """Queue a few hundred milliseconds of matrix work, then write ``value`` into ``t``, on ``stream``."""
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        a = torch.randn(4096, 4096, device="cuda")
        for _ in range(iterations):
            a = a @ a
            a = a / a.norm()
        t.copy_(torch.full_like(t, value) + 0 * a[0, 0])


def test_build_flags(hvd):
    assert hvd.cuda_built() and hvd.mpi_ops.cuda_built()
    assert hvd._check_has_gpu()
    major, minor, patch = torch.cuda.nccl.version()[:3]
    assert hvd.nccl_built() == major * 10000 + minor * 100 + patch  # NCCL's own version code


def test_allreduce_takes_nccl(hvd):
    """CUDA all-reduces go through the launcher's NCCL groups; their results are right for every dtype."""
    size = hvd.size()
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64):
        t = (torch.arange(1000, device="cuda") % 7 + hvd.rank()).to(dtype)  # small integers: exact in every dtype
        out = hvd.allreduce(t, op=hvd.Sum, name=f"gpu.nccl.{dtype}")
        expected = (torch.arange(1000, device="cuda") % 7) * size + sum(range(size))
        assert torch.equal(out.double(), expected.double()), dtype
    avg = hvd.allreduce(torch.full((5,), float(hvd.rank()), device="cuda"), name="gpu.nccl.avg")
    assert torch.allclose(avg, torch.full((5,), (size - 1) / 2, device="cuda"))
    launcher = device._launcher
    assert launcher is not None and (0, device._CUDA) in launcher._groups
    assert not launcher._entries


def test_other_collectives_take_nccl(hvd):
    """Broadcast, allgather (uneven), alltoall (splits) and reducescatter (uneven) of CUDA tensors: one NCCL
    launch each, the values of the CPU path, results on the GPU."""
    size, rank = hvd.size(), hvd.rank()
    hvd.allreduce(torch.ones(1, device="cuda"), name="gpu.other.warmup")
    before = hvd.device_stats()["launches"]
    out = hvd.broadcast(torch.full((3, 2), float(rank), device="cuda"), root_rank=size - 1, name="gpu.other.bc")
    assert out.is_cuda and torch.all(out == size - 1).item()
    rows = torch.arange((rank + 1) * 2, device="cuda", dtype=torch.float16).reshape(rank + 1, 2) + rank
    gathered = hvd.allgather(rows, name="gpu.other.ag")
    expected = torch.cat([torch.arange((r + 1) * 2, dtype=torch.float16).reshape(r + 1, 2) + r
                          for r in range(size)])
    assert gathered.is_cuda and torch.equal(gathered.cpu(), expected)
    splits = [(rank + d) % 2 + 1 for d in range(size)]
    src = torch.arange(sum(splits), device="cuda", dtype=torch.int64) + 100 * rank
    got, received = hvd.alltoall(src, splits=torch.tensor(splits), name="gpu.other.a2a")
    assert received.tolist() == [(s + rank) % 2 + 1 for s in range(size)] and got.is_cuda
    reduced = hvd.reducescatter(torch.ones(size * 2 + 1, 3, device="cuda"), op=hvd.Sum, name="gpu.other.rs")
    assert reduced.shape[0] == 2 + (1 if rank == 0 else 0) and torch.all(reduced == size).item()
    assert hvd.device_stats()["launches"] - before == 4


def test_synchronize_orders_the_stream_without_a_host_wait(hvd):
    """Stream-ordered completion: synchronize returns while the caller's stream still has the producing work
    queued (the host did not wait for the device), and work queued after it sees the result."""
    t = torch.zeros(1 << 20, device="cuda")
    _busy_then_fill(t, float(hvd.rank() + 1), iterations=200)
    hvd.synchronize(hvd.allreduce_async_(t, op=hvd.Sum, name="gpu.ordered"))
    pending = not torch.cuda.current_stream().query()
    total = t.sum()  # queued after the stream's wait for the all-reduce
    assert total.item() == sum(range(1, hvd.size() + 1)) * (1 << 20)
    assert pending, "synchronize waited on the host for the device"


def test_several_nccl_channels(hvd):
    """PERSEUS_NUM_NCCL_STREAMS=3: three groups, units spread over them, many requests in flight at once."""
    from job_env import restart

    old = restart(hvd, {"PERSEUS_NUM_NCCL_STREAMS": "3", "PERSEUS_DEVICE_FUSION_THRESHOLD": "65536"})
    try:
        tensors = [torch.full((20_000 + i,), float(i), device="cuda") for i in range(24)]
        handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=f"gpu.ch.{i}") for i, t in enumerate(tensors)]
        for h in handles:
            hvd.synchronize(h)
        for i, t in enumerate(tensors):
            assert torch.all(t == i * hvd.size()).item(), i
        assert len(device._launcher._groups[(0, device._CUDA)]) == 3
    finally:
        restart(hvd, old)


def test_optimizer_on_nccl_equals_cpu_path(hvd):
    """Three DistributedOptimizer steps on CUDA with the NCCL launcher (and fp16 compression) give the
    parameters of the CPU path."""
    from test_staging import _train

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    for compression, tol in ((hvd.Compression.none, 1e-5), (hvd.Compression.fp16, 1e-3)):
        reference = _train(hvd, "cpu", 3, compression, True, "gpu.opt.ref")
        got = _train(hvd, "cuda", 3, compression, True, "gpu.opt.nccl")
        torch.testing.assert_close(got, reference, rtol=tol, atol=tol)


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


def test_many_steps_reuse_pinned_buffers(hvd, monkeypatch):
    """Staging buffers come from torch's pinned host cache: 50 steps of the same sizes add no new blocks."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        pytest.skip("this torch has no torch.cuda.host_memory_stats to count pinned blocks")
    monkeypatch.setattr(device, "_nccl", False)  # all-reduces staged too (what PERSEUS_DEVICE_BACKEND=stage does)
    key = "num_host_alloc" if "num_host_alloc" in stats() else "allocations.allocated"
    grads = [torch.randn(n, device="cuda") for n in (1000, 1 << 16, 1 << 20)]
    for step in range(50):
        for i, g in enumerate(grads):
            hvd.allreduce_(g, name=f"gpu.steps.{i}")
        if step == 5:
            before = stats()[key]
    assert stats()[key] == before, stats()


def test_dear_on_nccl_and_adasum_staged(hvd):
    """DeAR (its groups on the GPU, reduce-scatter and all-gather on NCCL) and Adasum (staged): CUDA steps run and
    agree across ranks; DeAR's buffers are on the GPU."""
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
        if "schedule" in kw:
            assert all(g.buf.is_cuda and g.launcher for g in opt._schedule.groups)
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        gathered = hvd.allgather(flat.unsqueeze(0), name=f"gpu.{list(kw)[0]}.same")
        assert all(torch.equal(gathered[r], gathered[0]) for r in range(hvd.size()))
