"""Cupcake (fusion planned for a timeline model) and Espresso (a compression option per gradient) through
torch's DistributedOptimizer under mpirun: every rank adopts the same plan, parameters stay identical on
every rank, fused top-k at density 1 equals dense averaging, and no residual mass is lost when per-gradient
residuals become group residuals.
"""

import copy
import math
import zlib

import numpy as np
import pytest
import torch
import torch.nn as nn

from perseus.compression import REDUCERS
from perseus.compression.cupcake import Cupcake
from perseus.compression.espresso import Espresso
from perseus.compression.topk import TopK

pytestmark = pytest.mark.timeout(180)

STEPS = 6


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def train(hvd, model, compression, steps=STEPS, between=None):
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=compression)
    g = torch.Generator().manual_seed(100 + hvd.rank())
    for step in range(steps):
        x = torch.randn(16, 8, generator=g)
        y = torch.randn(16, 4, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if between is not None:
            between(step)
    return opt


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def assert_same_on_all_ranks(hvd, tensor, name):
    gathered = hvd.allgather(tensor.unsqueeze(0), name=name)
    for r in range(hvd.size()):
        torch.testing.assert_close(gathered[r], gathered[0], rtol=0, atol=0, msg=f"rank {r} differs")


def digest(obj) -> torch.Tensor:
    return torch.tensor([float(zlib.crc32(repr(obj).encode()))], dtype=torch.float64)


def grad_keys(model):
    return [f"grad.{n}" for n, _ in model.named_parameters()]


def test_registered_in_every_compression_namespace(hvd):
    assert REDUCERS["cupcake"] is Cupcake and REDUCERS["espresso"] is Espresso
    assert hvd.Compression.cupcake is Cupcake and hvd.Compression.espresso is Espresso
    assert "dense" not in REDUCERS


def test_cupcake_auto_plan_same_on_every_rank(hvd):
    model = mlp()
    cc = hvd.Compression.cupcake(hvd.Compression.topk(0.1))
    train(hvd, model, cc)
    assert cc.adopted
    plan = cc.plan
    assert sorted(k for g in plan for k in g) == sorted(grad_keys(model))
    # backward order: the last layer's gradients come first
    assert plan[0][0].startswith("grad.4.")
    assert_same_on_all_ranks(hvd, digest(plan), "cupcake.auto.plan")
    assert_same_on_all_ranks(hvd, flat(model), "cupcake.auto.params")
    m = cc.model
    assert m["encode"][0] >= 0 and m["encode"][1] >= 0 and m["comm"][0] >= 0 and m["comm"][1] >= 0
    assert m["predicted"] <= m["predicted_unfused"] * (1 + 1e-9)


def test_cupcake_one_group_when_encoding_is_expensive(hvd):
    """A huge fixed encode cost makes one group optimal: every gradient is reduced in one call."""
    model = mlp()
    cc = Cupcake(TopK(0.1), encode_cost=(1.0, 0.0))
    calls = []
    inner_reduce = cc.inner.reduce_async

    def spy(key, arrays, *a, **k):
        calls.append((key, len(arrays)))
        return inner_reduce(key, arrays, *a, **k)
    cc.inner.reduce_async = spy
    train(hvd, model, cc)
    keys = grad_keys(model)
    plan = cc.plan
    assert len(plan) == 1 and sorted(plan[0]) == sorted(keys) and plan[0][0].startswith("grad.4.")
    fused = [c for c in calls if c[1] == len(keys)]
    assert len(fused) == STEPS - 2  # one warm-up step, one profiled step, then one call per step
    assert {name for name, _ in fused} == {f"cupcake[{plan[0][0]}..{plan[0][-1]}]"}
    assert_same_on_all_ranks(hvd, flat(model), "cupcake.onegroup.params")


def test_cupcake_density_one_equals_dense(hvd):
    reference = mlp()
    model = copy.deepcopy(reference)
    train(hvd, reference, hvd.Compression.none)
    cc = Cupcake(TopK(1.0), encode_cost=(1e-3, 0.0), comm_cost=(1e-3, 0.0))
    train(hvd, model, cc)
    assert cc.adopted and len(cc.plan) < len(grad_keys(model))  # fused
    torch.testing.assert_close(flat(model), flat(reference), rtol=1e-5, atol=1e-6)
    assert_same_on_all_ranks(hvd, flat(model), "cupcake.dense.params")


def test_cupcake_residual_mass_carried_into_groups(hvd):
    model = mlp()
    cc = Cupcake(TopK(0.05), encode_cost=(1e-3, 0.0), comm_cost=(1e-3, 0.0))
    inner = cc.inner
    seen = {}
    adopt = cc._adopt

    def spy(plan, sizes, shapes=None):
        seen["before"] = {k: inner.residual(k).copy() for k in grad_keys(model)}
        adopt(plan, sizes, shapes)
        seen["after"] = {tuple(g): inner.residual(cc._groups[g[0]].name).copy() for g in plan}
    cc._adopt = spy
    train(hvd, model, cc)
    before, after = seen["before"], seen["after"]
    assert any(len(g) > 1 for g in after)
    for group, residual in after.items():
        parts = [before[k] for k in group]
        np.testing.assert_array_equal(residual, np.concatenate(parts))
    total_before = math.fsum(float(v) for k in grad_keys(model) for v in before[k])
    total_after = math.fsum(float(v) for r in after.values() for v in r)
    assert total_before == total_after and total_before != 0.0
    # each key still sees its own slice of its group's residual
    for group in after:
        for k in group:
            assert cc.residual(k).size == before[k].size
    assert_same_on_all_ranks(hvd, flat(model), "cupcake.residual.params")


def test_espresso_through_optimizer(hvd):
    model = mlp()
    es = hvd.Compression.espresso(density=0.1)
    policies = {3: "dense", 4: "all-compressed"}
    train(hvd, model, es, between=lambda step: step in policies and es.set_policy(policies[step]))
    assert es.decided
    choice = es.choices()
    assert sorted(choice) == sorted(grad_keys(model))
    assert_same_on_all_ranks(hvd, digest(sorted(choice.items())), "espresso.choice")
    rows = es.report()
    assert [r["name"] for r in rows][0].startswith("grad.4.")
    assert {r["option"] for r in rows} <= {"dense", "fp16", "topk(0.1)"}
    assert all(r["predicted_saving_s"] >= 0 for r in rows)
    text = es.format_report()
    assert "modelled iteration" in text and rows[0]["name"] in text
    assert es.policy == "all-compressed"
    assert_same_on_all_ranks(hvd, flat(model), "espresso.params")


def test_espresso_given_link_slow_compresses_fast_does_not(hvd):
    slow = Espresso(density=0.1, bandwidth_mbit=1.0, latency_us=50.0)
    train(hvd, mlp(), slow)
    big = max(slow.report(), key=lambda r: r["size"])
    assert big["option"] != "dense" and big["predicted_saving_s"] > 0
    fast = Espresso(density=0.1, bandwidth_mbit=1e9, latency_us=0.0)
    model = mlp()
    train(hvd, model, fast)
    # nothing worth its encode time on a free link: no top-k (a 16-bit cast may tie with dense: both copy)
    assert "topk(0.1)" not in set(fast.choices().values())
    assert all(r["predicted_saving_s"] < 1e-3 for r in fast.report())
    assert_same_on_all_ranks(hvd, flat(model), "espresso.fast.params")


def test_cupcake_over_an_allreduce_compressor_equals_dense(hvd):
    """An inner compressor that sums its payloads (here the internal dense float32 one): the probe times
    all-reduces; fused or not, the result is the plain average."""
    from perseus.compression.dense import Dense

    reference = mlp()
    model = copy.deepcopy(reference)
    train(hvd, reference, hvd.Compression.none)
    cc = Cupcake(Dense("float32"))
    train(hvd, model, cc)
    assert cc.adopted and sorted(k for g in cc.plan for k in g) == sorted(grad_keys(model))
    assert_same_on_all_ranks(hvd, digest(cc.plan), "cupcake.allreduce.plan")
    torch.testing.assert_close(flat(model), flat(reference), rtol=1e-5, atol=1e-6)
