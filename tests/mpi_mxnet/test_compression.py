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


# -- momentum correction -------------------------------------------------------------------------------------
MC_FEATURES, MC_BATCH, MC_LR, MC_MOMENTUM, MC_WD = 40, 8, 0.05, 0.9, 0.01


def _mc_data(hvd, steps):
    """Every rank's batches (rank, step, batch, feature) of a linear regression, and the initial weights."""
    rng = np.random.default_rng(66)
    X = rng.standard_normal((hvd.size(), steps, MC_BATCH, MC_FEATURES)).astype(np.float32)
    Y = rng.standard_normal((hvd.size(), steps, MC_BATCH, 1)).astype(np.float32)
    return X, Y, rng.uniform(-0.3, 0.3, (1, MC_FEATURES)).astype(np.float32), np.array([0.1], np.float32)


def _mc_params(kind):
    """SGD's or NAG's parameters. NAG without weight decay: MXNet's nag_mom_update decays its momentum state
    with the weight it has just updated, which Nesterov momentum on ``grad + wd * weight`` does not."""
    return {"learning_rate": MC_LR, "momentum": MC_MOMENTUM, "wd": MC_WD if kind == "sgd" else 0.0}


def _mc_trainer(hvd, how, compression, tag, kind="sgd"):
    """A factory of the trainer under test: 'trainer' (DistributedTrainer), 'split' (the same, driven by
    allreduce_grads() and update()) or 'optimizer' (gluon.Trainer over a DistributedOptimizer)."""
    if how == "optimizer":
        opt_cls = {"sgd": mx.optimizer.SGD, "nag": mx.optimizer.NAG}[kind]
        return lambda net: gluon.Trainer(net.collect_params(),
                                         hvd.DistributedOptimizer(opt_cls(**_mc_params(kind)), compression=compression),
                                         kvstore=None)
    return lambda net: hvd.DistributedTrainer(net.collect_params(), kind, _mc_params(kind), compression=compression,
                                              prefix=f"mc.{tag}.")


def _mc_train(hvd, make_trainer, steps, split=False):
    """This rank's training of ``Dense(1)`` under the L2 loss, one batch per step (``step(batch)``, or
    ``allreduce_grads()`` and ``update(batch)`` when ``split``); the flat weights and the trainer."""
    X, Y, W0, b0 = _mc_data(hvd, steps)
    net = gluon.nn.Dense(1, in_units=MC_FEATURES)
    net.initialize()
    net.weight.set_data(mx.nd.array(W0))
    net.bias.set_data(mx.nd.array(b0))
    trainer = make_trainer(net)
    loss_fn = gluon.loss.L2Loss()
    for t in range(steps):
        with mx.autograd.record():
            loss = loss_fn(net(mx.nd.array(X[hvd.rank(), t])), mx.nd.array(Y[hvd.rank(), t]))
        loss.backward()
        if split:
            trainer.allreduce_grads()
            trainer.update(MC_BATCH)
        else:
            trainer.step(MC_BATCH)
    return np.concatenate([net.weight.data().asnumpy().ravel(), net.bias.data().asnumpy()]), trainer


def _mc_sparsify(v, density):
    """What top-k sends of ``v`` and the indices sent (None: the whole vector, as top-k sends it when every
    entry goes or the sparse payload would be no smaller)."""
    from perseus.compression.base import CHECK_LEN
    n = v.size
    k = max(1, min(n, math.ceil(density * n)))
    if k == n or 2 * k + 1 >= n + CHECK_LEN:
        return v.copy(), None
    idx = np.argsort(-np.abs(v), kind="stable")[:k]
    sent = np.zeros_like(v)
    sent[idx] = v[idx]
    return sent, idx


def _mc_reference(hvd, steps, density, corrected):
    """NumPy (float64) SGD training of :func:`_mc_train` with top-k at ``density``: with momentum correction
    (each rank's ``grad / batch + wd * w`` through its velocity before top-k, masked where sent, plain SGD on
    the average) or without (top-k of the raw gradient, MXNet's momentum SGD on the average)."""
    X, Y, W0, b0 = _mc_data(hvd, steps)
    params = {"w": W0.astype(np.float64).ravel(), "b": b0.astype(np.float64)}
    velocity = {(r, k): None for r in range(hvd.size()) for k in params}
    residual = {(r, k): np.zeros_like(p) for r in range(hvd.size()) for k, p in params.items()}
    momentum = {k: np.zeros_like(p) for k, p in params.items()}
    for t in range(steps):
        grads = {}
        for r in range(hvd.size()):
            x, y = X[r, t].astype(np.float64), Y[r, t, :, 0].astype(np.float64)
            err = x @ params["w"] + params["b"][0] - y
            grads[r] = {"w": x.T @ err, "b": np.array([err.sum()])}
        for k, p in params.items():
            total = np.zeros_like(p)
            for r in range(hvd.size()):
                g = grads[r][k]
                if corrected:
                    g = g / MC_BATCH + MC_WD * p
                    u = velocity[r, k] = g.copy() if velocity[r, k] is None else MC_MOMENTUM * velocity[r, k] + g
                    residual[r, k] += u
                else:
                    residual[r, k] += g
                sent, idx = _mc_sparsify(residual[r, k], density)
                residual[r, k] -= sent
                if corrected and idx is not None:
                    u[idx] = 0.0
                total += sent
            avg = total / hvd.size()
            if corrected:
                params[k] = p - MC_LR * avg
            else:
                momentum[k] = MC_MOMENTUM * momentum[k] - MC_LR * (avg / MC_BATCH + MC_WD * p)
                params[k] = p + momentum[k]
    return np.concatenate([params["w"], params["b"]])


def _has_velocities(comp):
    return bool(comp._states) and all("velocity" in st.extra for st in comp._states.values())


@pytest.mark.parametrize("how,kind", [("trainer", "sgd"), ("trainer", "nag"), ("split", "sgd"), ("optimizer", "sgd"),
                                      ("optimizer", "nag")])
def test_momentum_correction_at_full_density_is_momentum_sgd(hvd, how, kind):
    steps, tag = 4, f"full.{how}.{kind}"
    comp = hvd.Compression.topk(1.0)
    full, trainer = _mc_train(hvd, _mc_trainer(hvd, how, comp, tag, kind), steps, how == "split")
    dense, _ = _mc_train(hvd, _mc_trainer(hvd, how, hvd.Compression.none, f"{tag}.dense", kind), steps,
                         how == "split")
    assert_same_everywhere(hvd, {"w": full}, tag)
    np.testing.assert_allclose(full, dense, rtol=1e-5, atol=1e-6)
    if kind == "sgd":
        np.testing.assert_allclose(full, _mc_reference(hvd, steps, 1.0, True), rtol=1e-4, atol=1e-5)
    assert _has_velocities(comp)  # the compressor applied the momentum
    opt = trainer._optimizer
    assert (opt.momentum, opt.wd, opt.rescale_grad) == (MC_MOMENTUM, _mc_params(kind)["wd"], 1.0 / MC_BATCH)


@pytest.mark.parametrize("how", ["trainer", "split", "optimizer"])
def test_momentum_correction_matches_reference(hvd, how):
    steps, density = 3, 0.1
    comp = hvd.Compression.topk(density)
    got, _ = _mc_train(hvd, _mc_trainer(hvd, how, comp, f"sparse.{how}"), steps, how == "split")
    assert_same_everywhere(hvd, {"w": got}, f"mc.sparse.{how}")
    np.testing.assert_allclose(got, _mc_reference(hvd, steps, density, True), rtol=1e-4, atol=1e-5)
    assert not np.allclose(got, _mc_reference(hvd, steps, density, False), rtol=1e-4, atol=1e-5)
    assert _has_velocities(comp)


@pytest.mark.parametrize("how", ["trainer", "optimizer"])
def test_momentum_correction_off_keeps_the_optimizers_momentum(hvd, how):
    steps, density = 3, 0.1
    comp = hvd.Compression.topk(density, momentum_correction=False)
    got, _ = _mc_train(hvd, _mc_trainer(hvd, how, comp, f"off.{how}"), steps)
    assert_same_everywhere(hvd, {"w": got}, f"mc.off.{how}")
    np.testing.assert_allclose(got, _mc_reference(hvd, steps, density, False), rtol=1e-4, atol=1e-5)
    assert not np.allclose(got, _mc_reference(hvd, steps, density, True), rtol=1e-4, atol=1e-5)
    assert comp._states and not any("velocity" in st.extra for st in comp._states.values())
