"""A training step in steady state allocates nothing that it could reuse: the native core's heap allocations
(perseus._core.native_allocations, every thread) and the Python memory traced by tracemalloc stay flat over
hundreds of steps once the first steps have sized every pool. What is left is high-water growth: a pool
that meets more operations in flight at once than ever before grows once."""

import tracemalloc

import pytest
import torch
import torch.nn as nn

import perseus
from perseus import _core

pytestmark = pytest.mark.timeout(240)

WARM, STEPS = 100, 200
# At most one high-water growth per 20 steps (a step here makes 20-30 requests; before pooling, ~120
# allocations per step).
MOST_PER_STEP = 0.05


def _tensors():
    # Small ones (the engine thread's lane), mid-sized ones (fused by a channel) and a large one (in place).
    return [torch.ones(n) for n in [10] * 8 + [1000] * 8 + [200_000] * 3 + [2_000_000]]


def _step(hvd, tensors):
    handles = [hvd.allreduce_async_(t, name=f"steady.{i}", op=hvd.Average) for i, t in enumerate(tensors)]
    for h in handles:
        hvd.synchronize(h)


def _per_step(fn) -> float:
    for _ in range(WARM):
        fn()
    before = _core.native_allocations()
    for _ in range(STEPS):
        fn()
    return (_core.native_allocations() - before) / STEPS


def test_asynchronous_allreduces_allocate_nothing_in_the_core(hvd):
    tensors = _tensors()
    per_step = _per_step(lambda: _step(hvd, tensors))
    assert per_step <= MOST_PER_STEP, f"rank {hvd.rank()}: {per_step:.2f} native allocations per step"


def test_a_synchronous_allreduce_allocates_nothing_in_the_core(hvd):
    one = torch.ones(1)
    per_call = _per_step(lambda: hvd.allreduce(one, name="steady.one"))
    assert per_call <= MOST_PER_STEP, f"rank {hvd.rank()}: {per_call:.2f} native allocations per call"


def test_an_optimizer_step_allocates_nothing_in_the_core(hvd):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))

    def train_step():
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    per_step = _per_step(train_step)
    assert per_step <= MOST_PER_STEP, f"rank {hvd.rank()}: {per_step:.2f} native allocations per optimizer step"


def test_python_memory_stays_flat_step_after_step(hvd):
    tensors = _tensors()
    for _ in range(WARM):
        _step(hvd, tensors)
    tracemalloc.start()
    try:
        for _ in range(20):
            _step(hvd, tensors)
        first = tracemalloc.take_snapshot()
        for _ in range(STEPS):
            _step(hvd, tensors)
        second = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    ours = [tracemalloc.Filter(True, perseus.__file__.rsplit("/", 1)[0] + "/*")]
    diff = second.filter_traces(ours).compare_to(first.filter_traces(ours), "lineno")
    grown = sum(d.size_diff for d in diff)
    top = "\n".join(str(d) for d in diff[:5])
    assert grown < 16 * 1024, f"rank {hvd.rank()}: perseus's Python memory grew {grown} bytes in {STEPS} steps:\n{top}"
