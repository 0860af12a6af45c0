"""Host staging of device tensors (perseus/torch/staging.py), on every collective and DistributedOptimizer.

Each test runs once with CPU tensors forced through the staging path (what PERSEUS_STAGE_CPU_TENSORS=1 does),
and once more on CUDA tensors where this machine has a GPU (tools/gpu_check.sh runs this file there). Results
are compared with values computed locally from every rank's input, or with the default (unstaged) CPU path.
A test fails if nothing was staged.
"""

import threading
import time

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import rank_data
from perseus.torch import _allreduce_ops, device, staging

pytestmark = pytest.mark.timeout(120)

DEVICES = ["staged-cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class Device:
    def __init__(self, kind, staged):
        self.kind, self.staged = kind, staged

    def put(self, t):
        """``t`` on the device under test (a copy for staged CPU, so the caller's tensor is never the input)."""
        return t.to("cuda") if self.kind == "cuda" else t.clone()

    def check(self, t):
        assert t.device.type == ("cuda" if self.kind == "cuda" else "cpu"), t.device
        return t.cpu()


@pytest.fixture(params=DEVICES)
def dev(request, monkeypatch):
    # Staging only: neither NCCL (CUDA) nor the gloo launcher (CPU, PERSEUS_DEVICE_BACKEND=gloo) takes over.
    monkeypatch.setattr(device, "_nccl", False)
    monkeypatch.setattr(device, "_gloo", False)
    monkeypatch.setattr(_allreduce_ops, "_plain_cpu", None)  # the flags are read again
    if request.param == "cuda":
        torch.cuda.set_device(0)
        # Exact float32 on the GPU, to compare with the CPU path (TF32 would differ in the 3rd digit).
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    else:
        monkeypatch.setattr(staging, "_stage_cpu", True)
    staged = []
    real, queued = staging.to_host, staging.to_host_queued
    monkeypatch.setattr(staging, "to_host", lambda t: (staged.append(t.device.type), real(t))[1])
    monkeypatch.setattr(staging, "to_host_queued", lambda t: (staged.append(t.device.type), queued(t))[1])
    yield Device(request.param, staged)
    assert staged, "nothing went through host staging"


def _all(hvd, shape, dtype, seed=0):
    return [torch.from_numpy(rank_data(r, shape, dtype, seed)) for r in range(hvd.size())]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.float16, torch.bfloat16])
def test_allreduce(hvd, dev, dtype):
    inputs = [t.to(dtype) for t in _all(hvd, (5, 3), "float32")]
    expected = torch.stack([t.double() for t in inputs]).sum(0)
    mine = dev.put(inputs[hvd.rank()])
    out = dev.check(hvd.allreduce(mine, op=hvd.Sum, name=f"st.sum.{dtype}"))
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected)
    torch.testing.assert_close(dev.check(mine).double(), inputs[hvd.rank()].double())  # input untouched
    if dtype.is_floating_point:
        avg = dev.check(hvd.allreduce(mine, name=f"st.avg.{dtype}", prescale_factor=2.0))
        torch.testing.assert_close(avg.double(), expected * 2 / hvd.size(), rtol=1e-2, atol=1e-2)


def test_allreduce_in_place_and_grouped(hvd, dev):
    inputs = _all(hvd, (4, 4), "float32", seed=1)
    expected = torch.stack(inputs).sum(0)
    t = dev.put(inputs[hvd.rank()])
    assert hvd.allreduce_(t, op=hvd.Sum, name="st.inplace") is t
    torch.testing.assert_close(dev.check(t), expected)

    ts = [dev.put(inputs[hvd.rank()] * (i + 1)) for i in range(3)]
    outs = hvd.grouped_allreduce(ts, op=hvd.Sum, name="st.grouped")
    for i, o in enumerate(outs):
        torch.testing.assert_close(dev.check(o), expected * (i + 1))
    same = hvd.grouped_allreduce_(ts, op=hvd.Sum, name="st.grouped_")
    for i, (o, t) in enumerate(zip(same, ts)):
        assert o is t
        torch.testing.assert_close(dev.check(t), expected * (i + 1))


def test_input_reused_before_synchronize(hvd, dev):
    """The input is copied at submission: overwriting or dropping it before synchronize changes nothing."""
    inputs = _all(hvd, (64, 33), "float32", seed=2)
    expected = torch.stack(inputs).sum(0)
    t = dev.put(inputs[hvd.rank()])
    handle = hvd.allreduce_async(t, op=hvd.Sum, name="st.reuse")
    t.fill_(1000.0)
    del t
    scratch = dev.put(torch.full((64, 33), -7.0))  # likely the freed block, on a GPU
    torch.testing.assert_close(dev.check(hvd.synchronize(handle)), expected)
    assert float(scratch.sum()) == -7.0 * 64 * 33


def test_allgather_broadcast(hvd, dev):
    rows = [torch.full((r + 1, 2), float(r)) for r in range(hvd.size())]
    out = dev.check(hvd.allgather(dev.put(rows[hvd.rank()]), name="st.gather"))
    torch.testing.assert_close(out, torch.cat(rows))
    bf = dev.check(hvd.allgather(dev.put(rows[hvd.rank()].bfloat16()), name="st.gather.bf16"))
    torch.testing.assert_close(bf.float(), torch.cat(rows))
    outs = hvd.grouped_allgather([dev.put(rows[hvd.rank()]), dev.put(rows[hvd.rank()] + 1)], name="st.ggather")
    torch.testing.assert_close(dev.check(outs[1]), torch.cat(rows) + 1)

    root = 1 % hvd.size()
    value = torch.arange(6.0).reshape(2, 3) + hvd.rank()
    got = dev.check(hvd.broadcast(dev.put(value), root_rank=root, name="st.bcast"))
    torch.testing.assert_close(got, torch.arange(6.0).reshape(2, 3) + root)
    t = dev.put(value)
    hvd.broadcast_(t, root_rank=root, name="st.bcast_")
    torch.testing.assert_close(dev.check(t), torch.arange(6.0).reshape(2, 3) + root)


def test_alltoall_reducescatter(hvd, dev):
    size, rank = hvd.size(), hvd.rank()
    splits = torch.tensor([i + 1 for i in range(size)], dtype=torch.int32)
    data = torch.cat([torch.full((i + 1, 2), float(rank * 10 + i)) for i in range(size)])
    out, received = hvd.alltoall(dev.put(data), splits=splits, name="st.a2a")
    expected = torch.cat([torch.full((rank + 1, 2), float(r * 10 + rank)) for r in range(size)])
    torch.testing.assert_close(dev.check(out), expected)
    assert received.tolist() == [rank + 1] * size

    inputs = _all(hvd, (2 * size + 1, 3), "float32", seed=3)
    total = torch.stack(inputs).sum(0)
    share = dev.check(hvd.reducescatter(dev.put(inputs[rank]), op=hvd.Sum, name="st.rs"))
    counts = [total.shape[0] // size + (1 if r < total.shape[0] % size else 0) for r in range(size)]
    start = sum(counts[:rank])
    torch.testing.assert_close(share, total[start:start + counts[rank]])
    shares = hvd.grouped_reducescatter([dev.put(inputs[rank]), dev.put(inputs[rank] * 2)], op=hvd.Sum,
                                       name="st.grs")
    torch.testing.assert_close(dev.check(shares[1]), 2 * total[start:start + counts[rank]])


def test_sparse_allreduce(hvd, dev):
    rank = hvd.rank()
    idx = torch.tensor([[rank, rank + 1]])
    val = torch.ones(2, 3) * (rank + 1)
    sp = torch.sparse_coo_tensor(idx, val, (hvd.size() + 1, 3))
    if dev.kind == "cuda":
        sp = sp.cuda()
    # (sparse tensors are moved by their own path; one dense tensor is staged so that the fixture sees staging)
    hvd.allreduce(dev.put(torch.ones(1)), name="st.sparse.dense")
    out = hvd.sparse_allreduce_async(sp, name="st.sparse", op=hvd.Sum, algorithm="allgather")()
    dense = dev.check(out.to_dense())
    expected = sum(torch.sparse_coo_tensor(torch.tensor([[r, r + 1]]), torch.ones(2, 3) * (r + 1),
                                           (hvd.size() + 1, 3)).to_dense() for r in range(hvd.size()))
    torch.testing.assert_close(dense, expected)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        return self.fc(F.max_pool2d(F.relu(self.bn(self.conv(x))), 2).flatten(1))


def _train(hvd, device, steps, compression, sync_bn, name):
    torch.manual_seed(7)
    model = Net()
    if sync_bn:
        model.bn = hvd.SyncBatchNorm(4)
    model = model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=[(f"{name}.{n}", p) for n, p in model.named_parameters()],
                                   compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + hvd.rank())
        x, y = torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x.to(device)), y.to(device)).backward()
        opt.step()
    return torch.cat([p.detach().cpu().flatten() for p in model.parameters()])


@pytest.mark.parametrize("compression,sync_bn", [("none", False), ("fp16", True), ("topk", False)])
def test_optimizer_equals_cpu_path(hvd, dev, monkeypatch, compression, sync_bn):
    """Three DistributedOptimizer steps (SyncBatchNorm, fp16 or a top-k compressor as given) give the
    parameters the unstaged CPU path gives."""
    comp = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}.get(compression)
    make = (lambda: hvd.Compression.topk(0.5)) if compression == "topk" else (lambda: comp)
    tag = f"st.opt.{compression}.{dev.kind}"
    with monkeypatch.context() as m:
        m.setattr(staging, "_stage_cpu", False)
        m.setattr(_allreduce_ops, "_plain_cpu", None)
        reference = _train(hvd, "cpu", 3, make(), sync_bn, f"{tag}.ref")
    got = _train(hvd, "cuda" if dev.kind == "cuda" else "cpu", 3, make(), sync_bn, tag)
    tol = 1e-3 if compression == "fp16" else 1e-5
    torch.testing.assert_close(got, reference, rtol=tol, atol=tol)
    gathered = hvd.allgather(got.unsqueeze(0), name=f"{tag}.same")
    for r in range(hvd.size()):
        assert torch.equal(gathered[r], gathered[0])


def test_only_cpu_and_cuda_are_accepted(hvd):
    t = torch.ones(2, device="meta")
    with pytest.raises(NotImplementedError, match="meta"):
        staging.to_host(t)


def test_stage_cpu_flag_is_read_from_settings(hvd, monkeypatch):
    monkeypatch.setattr(staging, "_stage_cpu", None)
    expected = hvd.mpi_ops._runtime.settings.stage_cpu_tensors
    assert staging.stage_cpu() is bool(expected)
    assert staging.wanted(torch.ones(1)) is bool(expected)


def test_non_staging_paths_refuse_device_tensors_clearly(hvd):
    from perseus.torch._tensors import _np

    with pytest.raises(NotImplementedError, match="CPU tensors only"):
        _np(torch.ones(2, device="meta"))
    assert np.array_equal(_np(torch.ones(2)), np.ones(2, np.float32))


class LateCopies(staging.HostOps):
    """CPU staging whose copies to the host finish late, on timer threads (as a busy GPU's would): the request
    may reach the engine only once its copy is there."""

    def __init__(self, delay):
        self.delay = delay
        self.pending = 0

    def to_host_queued(self, host, src):
        done = threading.Event()
        src = src.clone()  # what src holds now (the caller may overwrite it once the call returns)

        def copy():
            host.copy_(src)
            done.set()
        threading.Timer(self.delay, copy).start()
        return done

    def wait_copied(self, token):
        assert token.wait(30)


def test_staged_allreduce_does_not_wait_for_its_copy(hvd, monkeypatch):
    """The copy out of a staged all-reduce is queued: the call returns at once with a handle that synchronize
    and poll take, the request reaches the engine from the stager once the copy is done, in call order, unnamed
    calls get the names they would have had, and training is unchanged."""
    size, rank = hvd.size(), hvd.rank()
    monkeypatch.setattr(device, "_gloo", False)
    monkeypatch.setattr(staging, "_stage_cpu", True)
    monkeypatch.setattr(_allreduce_ops, "_plain_cpu", None)
    monkeypatch.setattr(staging, "_HOST_OPS", LateCopies(0.3))
    t = torch.full((1000,), float(rank + 1))
    start = time.monotonic()
    handle = hvd.allreduce_async_(t, op=hvd.Sum, name="st.late")
    assert time.monotonic() - start < 0.2, "the call waited for the copy"
    assert isinstance(handle, staging.Deferred) and not hvd.poll(handle)
    assert hvd.synchronize(handle) is t and torch.all(t == size * (size + 1) / 2)
    # Unnamed, out of place, grouped, many in a row: the values of the direct path, in call order.
    handles = [hvd.allreduce_async(torch.full((3,), float(i + rank)), op=hvd.Sum) for i in range(6)]
    grouped = hvd.grouped_allreduce_async([torch.ones(2), torch.full((4,), float(rank))], op=hvd.Sum,
                                          name="st.late.group")
    for i, h in enumerate(handles):
        assert hvd.synchronize(h).tolist() == [size * i + size * (size - 1) / 2] * 3, i
    a, b = hvd.synchronize(grouped)
    assert a.tolist() == [float(size)] * 2 and b.tolist() == [size * (size - 1) / 2] * 4
    # join() right after a call: the request reaches the engine before the rank joins.
    t = torch.full((5,), float(rank))
    handle = hvd.allreduce_async_(t, op=hvd.Sum, name="st.late.join")
    hvd.join()
    assert hvd.synchronize(handle).tolist() == [size * (size - 1) / 2] * 5
    monkeypatch.setattr(staging, "_HOST_OPS", LateCopies(0.01))
    got = _train(hvd, "cpu", 3, hvd.Compression.none, False, "st.late.opt")
    monkeypatch.setattr(staging, "_stage_cpu", False)
    monkeypatch.setattr(_allreduce_ops, "_plain_cpu", None)
    reference = _train(hvd, "cpu", 3, hvd.Compression.none, False, "st.late.ref")
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)
