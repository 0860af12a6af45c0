"""The communicating compressors (perseus.compression) through perseus.mxnet: allreduce with
compression=Compression.topk(...), and DistributedTrainer/DistributedOptimizer training with top-k (every rank
ends with identical parameters; density 1.0 trains like no compression). References are built locally from
every rank's deterministic input, so the tests hold at any world size."""

import math

import mxnet as mx
import numpy as np
import pytest
from mxnet import gluon

from perseus.compression import REDUCERS

pytestmark = pytest.mark.timeout(180)

BATCH, FEATURES, CLASSES, STEPS = 8, 6, 3, 4


def rank_vector(r, n, seed=0):
    """Rank ``r``'s input: distinct magnitudes, so every top-k selection is unique."""
    return np.random.default_rng(1000 * seed + r).standard_normal(n).astype(np.float32)


def topk_sparse(x, density):
    """What top-k sends for ``x`` (dense, the rest zero) and what it keeps as residual."""
    k = max(1, min(x.size, math.ceil(density * x.size)))
    idx = np.argsort(-np.abs(x), kind="stable")[:k]
    sent = np.zeros_like(x)
    sent[idx] = x[idx]
    return sent, x - sent


def assert_same_everywhere(hvd, arrays, tag):
    for name, a in sorted(arrays.items()):
        gathered = hvd.allgather(mx.nd.array(np.asarray(a)[None]), name=f"same.{tag}.{name}").asnumpy()
        for other in gathered:
            np.testing.assert_array_equal(other, a, err_msg=name)


def test_compression_namespace_names_every_reducer(hvd):
    for name, cls in REDUCERS.items():
        assert getattr(hvd.Compression, name) is cls, name
    assert hvd.Compression.none is not None and hvd.Compression.fp16 is not None


def test_allreduce_topk_matches_reference_over_two_steps(hvd):
    density, n = 0.25, 40
    comp = hvd.Compression.topk(density)
    residuals = [np.zeros(n, np.float32) for _ in range(hvd.size())]
    for step in range(2):
        x = mx.nd.array(rank_vector(hvd.rank(), n, seed=step))
        got = hvd.allreduce(x, name="mx.topk.two_steps", compression=comp)
        assert isinstance(got, mx.nd.NDArray) and got.shape == (n,) and got.dtype == np.float32
        np.testing.assert_array_equal(x.asnumpy(), rank_vector(hvd.rank(), n, seed=step))  # input untouched
        ref = np.zeros(n, np.float64)
        for r in range(hvd.size()):
            sent, residuals[r] = topk_sparse(residuals[r] + rank_vector(r, n, seed=step), density)
            ref += sent
        np.testing.assert_allclose(got.asnumpy(), ref / hvd.size(), rtol=1e-5, atol=1e-6)
        assert_same_everywhere(hvd, {"out": got.asnumpy()}, f"two_steps.{step}")
    assert list(comp._states) == ["mx.topk.two_steps"]
    np.testing.assert_allclose(comp.residual("mx.topk.two_steps"), residuals[hvd.rank()], rtol=1e-6)


def test_allreduce_inplace_grouped_and_float16_with_full_density(hvd):
    comp = hvd.Compression.topk(1.0)
    size = hvd.size()
    x = mx.nd.array(rank_vector(hvd.rank(), 12, seed=3).reshape(3, 4), dtype="float16")
    out = hvd.allreduce_(x, name="mx.full.f16", op=hvd.Sum, compression=comp)
    assert out is x and x.dtype == np.float16
    ref = sum(rank_vector(r, 12, seed=3).astype(np.float16).astype(np.float64) for r in range(size))
    np.testing.assert_allclose(x.asnumpy().ravel(), ref, rtol=1e-2, atol=1e-2)
    a = mx.nd.array(rank_vector(hvd.rank(), 5, seed=4))
    b = mx.nd.array(rank_vector(hvd.rank(), 6, seed=5).reshape(2, 3), dtype="float64")
    outs = hvd.grouped_allreduce([a, b], name="mx.full.group", compression=comp, prescale_factor=2.0)
    np.testing.assert_allclose(outs[0].asnumpy(), 2 * np.mean([rank_vector(r, 5, seed=4) for r in range(size)], 0),
                               rtol=1e-5, atol=1e-6)
    assert outs[1].dtype == np.float64 and outs[1].shape == (2, 3)
    np.testing.assert_allclose(outs[1].asnumpy().ravel(),
                               2 * np.mean([rank_vector(r, 6, seed=5) for r in range(size)], 0), rtol=1e-5, atol=1e-6)
    assert set(comp._states) == {"mx.full.f16", "mx.full.group"}


def test_allreduce_topk_rejects_what_it_cannot_do(hvd):
    comp = hvd.Compression.topk(0.5)
    with pytest.raises(hvd.PerseusMXNetValueError, match="name"):
        hvd.allreduce(mx.nd.ones((3,)), compression=comp)
    with pytest.raises(hvd.PerseusMXNetValueError, match="floating-point"):
        hvd.allreduce(mx.nd.ones((3,), dtype="int32"), name="mx.ints", compression=comp)
    with pytest.raises(hvd.PerseusMXNetValueError, match="Sum or Average"):
        hvd.allreduce(mx.nd.ones((3,)), name="mx.max", op=hvd.Max, compression=comp)


# -- training ------------------------------------------------------------------------------------------------
def make_net():
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(8, in_units=FEATURES, activation="relu"), gluon.nn.Dense(CLASSES, in_units=8))
    return net


def values(net):
    return {f"{i:02d}": p.data().asnumpy() for i, p in enumerate(net.collect_params().values())}


def trained(hvd, make_trainer, seed=0):
    """Parameters after STEPS steps on this rank's share of a global batch, from rank 0's initial values."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(hvd.size() * BATCH, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=hvd.size() * BATCH).astype(np.float32)
    mx.random.seed(seed + 17 * hvd.rank())
    net = make_net()
    net.initialize(mx.init.Xavier())
    hvd.broadcast_parameters(net.collect_params(), root_rank=0, prefix=f"compress{seed}.")
    trainer = make_trainer(net)
    mine = slice(hvd.rank() * BATCH, (hvd.rank() + 1) * BATCH)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for _ in range(STEPS):
        with mx.autograd.record():
            loss = loss_fn(net(mx.nd.array(x[mine])), mx.nd.array(y[mine]))
        loss.backward()
        trainer.step(BATCH)
    return values(net)


@pytest.mark.parametrize("num_groups", [0, 2])
def test_distributed_trainer_topk(hvd, num_groups):
    params = {"learning_rate": 0.1, "momentum": 0.9}

    def with_compression(comp, tag):
        return lambda net: hvd.DistributedTrainer(net.collect_params(), "sgd", dict(params), compression=comp,
                                                  num_groups=num_groups, prefix=f"{tag}{num_groups}.")
    comp = hvd.Compression.topk(0.3)
    sparse = trained(hvd, with_compression(comp, "sparse"), seed=10)
    assert_same_everywhere(hvd, sparse, f"trainer.sparse.{num_groups}")
    assert len(comp._states) == (2 if num_groups else 4)
    full = trained(hvd, with_compression(hvd.Compression.topk(1.0), "full"), seed=10)
    plain = trained(hvd, with_compression(hvd.Compression.none, "plain"), seed=10)
    assert_same_everywhere(hvd, full, f"trainer.full.{num_groups}")
    for k in plain:
        np.testing.assert_allclose(full[k], plain[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert any(not np.allclose(sparse[k], plain[k], rtol=1e-5, atol=1e-6) for k in plain)


def test_distributed_optimizer_topk(hvd):
    params = {"learning_rate": 0.1, "momentum": 0.9}

    def with_compression(comp):
        opt = hvd.DistributedOptimizer(mx.optimizer.SGD(**params), compression=comp)
        return lambda net: gluon.Trainer(net.collect_params(), opt, kvstore=None)
    comp = hvd.Compression.topk(0.3)
    sparse = trained(hvd, with_compression(comp), seed=20)
    assert_same_everywhere(hvd, sparse, "optimizer.sparse")
    assert comp._states and all(k.startswith("DistributedOptimizer.") for k in comp._states)
    full = trained(hvd, with_compression(hvd.Compression.topk(1.0)), seed=20)
    plain = trained(hvd, with_compression(None), seed=20)
    for k in plain:
        np.testing.assert_allclose(full[k], plain[k], rtol=1e-5, atol=1e-6, err_msg=k)


#: how to build each compressor for a small test; a REDUCERS entry missing here is built without arguments
FACTORIES = {
    "topk": lambda c: c(0.3), "hitopk": lambda c: c(0.3), "randomk": lambda c: c(0.3),
    "cupcake": lambda c: c(REDUCERS["topk"](0.3)),
}


@pytest.mark.parametrize("name", sorted(REDUCERS))
def test_distributed_trainer_every_compressor_keeps_ranks_identical(hvd, name):
    try:
        comp = FACTORIES.get(name, lambda c: c())(REDUCERS[name])
    except TypeError as exc:
        pytest.fail(f"Compression.{name} cannot be built with its test factory or without arguments "
                    f"({exc}): add an entry to FACTORIES")
    got = trained(hvd, lambda net: hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                                                          compression=comp, prefix=f"every.{name}."), seed=30)
    assert all(np.isfinite(v).all() for v in got.values())
    assert_same_everywhere(hvd, got, f"every.{name}")
