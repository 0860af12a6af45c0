"""Data-parallel training with DistributedTrainer and DistributedOptimizer: every rank ends with identical
parameters, equal to one process training on the global batch; broadcast_parameters in all its forms."""

import warnings

import mxnet as mx
import numpy as np
import pytest
from mxnet import gluon

pytestmark = pytest.mark.timeout(180)

BATCH, FEATURES, CLASSES, STEPS = 8, 6, 3, 4


def global_data(size, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(size * BATCH, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=size * BATCH).astype(np.float32)
    return x, y


def make_net():
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(8, in_units=FEATURES, activation="relu"), gluon.nn.Dense(CLASSES, in_units=8))
    return net


def values(net):
    """Parameter values keyed by position (MXNet 1.x names carry process-wide counters: dense0, dense4...)."""
    return {f"{i:02d}": p.data().asnumpy() for i, p in enumerate(net.collect_params().values())}


def copy_values(src, dst):
    for a, b in zip(src.collect_params().values(), dst.collect_params().values()):
        b.set_data(a.data().copy())


def synced_net(hvd, seed):
    """A net whose random initial values differ per rank until broadcast_parameters makes them rank 0's."""
    mx.random.seed(seed + 17 * hvd.rank())
    net = make_net()
    net.initialize(mx.init.Xavier())
    hvd.broadcast_parameters(net.collect_params(), root_rank=0, prefix=f"init{seed}.")
    return net


def train(net, trainer, x, y, batch):
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for _ in range(STEPS):
        with mx.autograd.record():
            loss = loss_fn(net(mx.nd.array(x)), mx.nd.array(y))
        loss.backward()
        trainer.step(batch)


def assert_same_everywhere(hvd, arrays, process_set=None):
    """Bitwise identical on every rank of the set."""
    ps = process_set or hvd.global_process_set
    for name, a in sorted(arrays.items()):
        gathered = hvd.allgather(mx.nd.array(a[None]), name=f"same.{name}", process_set=ps).asnumpy()
        for other in gathered:
            np.testing.assert_array_equal(other, a, err_msg=name)


def reference(hvd, start, x, y, optimizer, optimizer_params):
    """One process, the global batch, a plain gluon.Trainer."""
    ref = make_net()
    ref.initialize()
    copy_values(start, ref)
    trainer = gluon.Trainer(ref.collect_params(), optimizer, dict(optimizer_params), kvstore=None)
    train(ref, trainer, x, y, len(x))
    return values(ref)


def check_against_reference(hvd, got, want, rtol=1e-5, atol=1e-6):
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=atol, err_msg=k)


TRAINER_CASES = {
    "plain": dict(),
    "groups_predivide": dict(num_groups=2, gradient_predivide_factor=2.0),
    "fp16": dict(compression="fp16"),
}


@pytest.mark.parametrize("case", sorted(TRAINER_CASES))
@pytest.mark.parametrize("optimizer,params", [("sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3}),
                                              ("adam", {"learning_rate": 0.01})])
def test_distributed_trainer_matches_single_process(hvd, case, optimizer, params):
    rank, size = hvd.rank(), hvd.size()
    kwargs = dict(TRAINER_CASES[case])
    if kwargs.get("compression") == "fp16":
        kwargs["compression"] = hvd.Compression.fp16
    x, y = global_data(size, seed=1)
    net = synced_net(hvd, seed=len(case) + len(optimizer))
    start = make_net()
    start.initialize()
    copy_values(net, start)
    trainer = hvd.DistributedTrainer(net.collect_params(), optimizer, dict(params),
                                     prefix=f"{case}.{optimizer}.", **kwargs)
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    train(net, trainer, x[mine], y[mine], BATCH)
    got = values(net)
    assert_same_everywhere(hvd, got)
    want = reference(hvd, start, x, y, optimizer, params)
    if case == "fp16":
        check_against_reference(hvd, got, want, rtol=1e-2, atol=1e-3)
    else:
        check_against_reference(hvd, got, want)


@pytest.mark.parametrize("num_groups", [0, 2])
def test_distributed_optimizer_in_gluon_trainer(hvd, num_groups):
    rank, size = hvd.rank(), hvd.size()
    x, y = global_data(size, seed=2)
    net = synced_net(hvd, seed=40 + num_groups)
    start = make_net()
    start.initialize()
    copy_values(net, start)
    params = {"learning_rate": 0.1, "momentum": 0.9}
    opt = hvd.DistributedOptimizer(mx.optimizer.SGD(**params), num_groups=num_groups)
    trainer = gluon.Trainer(net.collect_params(), opt, kvstore=None)
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    train(net, trainer, x[mine], y[mine], BATCH)
    assert opt.rescale_grad == pytest.approx(1.0 / BATCH)  # set by the Trainer, on the wrapped optimizer
    assert opt._optimizer.rescale_grad == pytest.approx(1.0 / BATCH)
    got = values(net)
    assert_same_everywhere(hvd, got)
    check_against_reference(hvd, got, reference(hvd, start, x, y, "sgd", params))


def test_distributed_optimizer_with_module_api(hvd):
    rank, size = hvd.rank(), hvd.size()
    x, y = global_data(size, seed=3)

    def module(batch):
        data = mx.sym.var("data")
        fc = mx.sym.FullyConnected(data, num_hidden=CLASSES, name="fc")
        out = mx.sym.SoftmaxOutput(fc, name="softmax")
        mod = mx.mod.Module(out, data_names=["data"], label_names=["softmax_label"], context=mx.cpu())
        mod.bind(data_shapes=[("data", (batch, FEATURES))], label_shapes=[("softmax_label", (batch,))])
        return mod

    mx.random.seed(100 + rank)
    mod = module(BATCH)
    mod.init_params(mx.init.Uniform(0.5))
    arg, aux = mod.get_params()
    hvd.broadcast_parameters(arg, root_rank=0, prefix="module.")
    mod.set_params(arg, aux)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod.init_optimizer(kvstore=None, optimizer=hvd.DistributedOptimizer(
            mx.optimizer.SGD(learning_rate=0.5, rescale_grad=1.0 / BATCH)))
    ref = module(size * BATCH)
    ref.init_params()
    ref.set_params(arg, aux)
    ref.init_optimizer(kvstore=None, optimizer=mx.optimizer.SGD(learning_rate=0.5, rescale_grad=1.0 / (size * BATCH)))
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    for _ in range(STEPS):
        mod.forward_backward(mx.io.DataBatch([mx.nd.array(x[mine])], [mx.nd.array(y[mine])]))
        mod.update()
        ref.forward_backward(mx.io.DataBatch([mx.nd.array(x)], [mx.nd.array(y)]))
        ref.update()
    got = {k: v.asnumpy() for k, v in mod.get_params()[0].items()}
    want = {k: v.asnumpy() for k, v in ref.get_params()[0].items()}
    assert_same_everywhere(hvd, got)
    check_against_reference(hvd, got, want)


def test_distributed_optimizer_direct_update(hvd):
    """update() with one index and with a list of indices (MXNet's aggregated updates)."""
    rank, size = hvd.rank(), hvd.size()
    opt = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=1.0), gradient_predivide_factor=4.0)
    w = mx.nd.zeros((3, 4))
    g = mx.nd.ones((3, 4)) * (rank + 1)
    opt.update(0, w, g, opt.create_state(0, w))
    mean = sum(r + 1 for r in range(size)) / size
    np.testing.assert_allclose(w.asnumpy(), -np.full((3, 4), mean), rtol=1e-6)
    ws = [mx.nd.zeros((2,)), mx.nd.zeros((5,))]
    gs = [mx.nd.ones((2,)) * rank, mx.nd.ones((5,)) * 2 * rank]
    states = [opt.create_state_multi_precision(i, w_) for i, w_ in zip((1, 2), ws)]
    opt.update_multi_precision([1, 2], ws, gs, states)
    mean_rank = sum(range(size)) / size
    np.testing.assert_allclose(ws[0].asnumpy(), -np.full(2, mean_rank), rtol=1e-6)
    np.testing.assert_allclose(ws[1].asnumpy(), -np.full(5, 2 * mean_rank), rtol=1e-6)
    opt.set_learning_rate(0.5)
    assert opt.learning_rate == 0.5 and opt._optimizer.lr == 0.5
    opt.lr = 0.25
    assert opt._optimizer.lr == 0.25


def test_trainer_and_optimizer_on_a_process_set(hvd):
    rank, size = hvd.rank(), hvd.size()
    if size == 1:
        pytest.skip("needs 2+ ranks")
    even = hvd.add_process_set([r for r in range(size) if r % 2 == 0])
    try:
        x, y = global_data(size, seed=4)
        net = synced_net(hvd, seed=60)
        trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, prefix="ps.",
                                         process_set=even)
        mine = slice(rank * BATCH, (rank + 1) * BATCH)
        train(net, trainer, x[mine], y[mine], BATCH)
        got = values(net)
        if rank in even.ranks:
            assert_same_everywhere(hvd, got, process_set=even)
        # On ranks outside the set the optimizer updates with local gradients only.
        opt = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=1.0), process_set=even)
        w = mx.nd.zeros((2,))
        opt.update(7, w, mx.nd.ones((2,)) * rank, None)
        members = even.ranks
        expect = -sum(members) / len(members) if rank in members else -rank
        np.testing.assert_allclose(w.asnumpy(), np.full(2, expect), rtol=1e-6)
    finally:
        hvd.remove_process_set(even)


def test_two_trainers_with_prefixes(hvd):
    net1, net2 = gluon.nn.Dense(5, in_units=4), gluon.nn.Dense(7, in_units=4)
    mx.random.seed(hvd.rank())
    net1.initialize()
    net2.initialize()
    hvd.broadcast_parameters(net1.collect_params(), prefix="two.net1.")
    hvd.broadcast_parameters(net2.collect_params(), prefix="two.net2.")
    t1 = hvd.DistributedTrainer(net1.collect_params(), "sgd", {"learning_rate": 0.1}, prefix="two.t1.")
    t2 = hvd.DistributedTrainer(net2.collect_params(), "sgd", {"learning_rate": 0.1}, prefix="two.t2.")
    for _ in range(3):
        data = mx.nd.ones((3, 4)) * (hvd.rank() + 1)
        with mx.autograd.record():
            a, b = net1(data).sum(), net2(data).sum()
        mx.autograd.backward([a, b])
        t1.step(3)
        t2.step(3)
    assert_same_everywhere(hvd, {**{f"1{k}": v for k, v in values(net1).items()},
                                 **{f"2{k}": v for k, v in values(net2).items()}})


def test_trainer_unwraps_distributed_optimizer_and_checks_arguments(hvd):
    net = gluon.nn.Dense(2, in_units=2)
    net.initialize()
    with pytest.warns(UserWarning, match="unwrapped"):
        trainer = hvd.DistributedTrainer(net.collect_params(), hvd.DistributedOptimizer(mx.optimizer.SGD()))
    assert not isinstance(trainer._optimizer, hvd.DistributedOptimizer)
    with pytest.raises(ValueError, match="prefix"):
        hvd.DistributedTrainer(net.collect_params(), "sgd", prefix=3)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedTrainer(net.collect_params(), "sgd", gradient_predivide_factor=0.0)
    with pytest.raises(TypeError, match="Optimizer"):
        hvd.DistributedOptimizer("sgd")


def test_broadcast_parameters_dict_of_ndarrays(hvd):
    rank, size = hvd.rank(), hvd.size()
    root = size - 1
    dtypes = ["uint8", "int8", "int32", "int64", "float16", "float32", "float64"]
    params = {f"p{i}": mx.nd.ones((3, i + 1), dtype=dt) * (rank + 1) for i, dt in enumerate(dtypes)}
    hvd.broadcast_parameters(params, root_rank=root, prefix="dict.")
    for i, dt in enumerate(dtypes):
        assert params[f"p{i}"].dtype == np.dtype(dt)
        np.testing.assert_array_equal(params[f"p{i}"].asnumpy(), np.full((3, i + 1), root + 1, dt))


def test_broadcast_parameters_deferred_initialisation(hvd):
    rank = hvd.rank()
    mx.random.seed(rank)
    layer = gluon.nn.Conv2D(4, 2)  # shapes unknown until the first forward pass
    layer.initialize()
    hvd.broadcast_parameters(layer.collect_params(), root_rank=0, prefix="deferred.")
    layer(mx.nd.ones((2, 3, 5, 5)))  # initialises, then broadcasts from rank 0
    got = values(layer)
    assert_same_everywhere(hvd, got)
    if hvd.size() > 1:
        mx.random.seed(rank)
        fresh = gluon.nn.Conv2D(4, 2)
        fresh.initialize()
        fresh(mx.nd.ones((2, 3, 5, 5)))
        if rank != 0:  # without the broadcast this rank would have had its own values
            assert any(not np.array_equal(a, b) for a, b in zip(values(fresh).values(), got.values()))


def test_distributed_trainer_convolution_network(hvd):
    """Convolutions run through MXNet's MKL-DNN kernels; their gradients are reduced like any other."""
    rank, size = hvd.rank(), hvd.size()

    def conv_net():
        net = gluon.nn.HybridSequential()
        net.add(gluon.nn.Conv2D(4, 3, in_channels=1, activation="relu"), gluon.nn.MaxPool2D(),
                gluon.nn.Flatten(), gluon.nn.Dense(CLASSES, in_units=4 * 3 * 3))
        return net

    mx.random.seed(rank)
    net = conv_net()
    net.initialize(mx.init.Xavier())
    net.hybridize()
    hvd.broadcast_parameters(net.collect_params(), root_rank=0, prefix="conv.")
    ref = conv_net()
    ref.initialize()
    ref.hybridize()
    copy_values(net, ref)
    rng = np.random.default_rng(5)
    x = rng.normal(size=(size * BATCH, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=size * BATCH).astype(np.float32)
    params = {"learning_rate": 0.1, "momentum": 0.9}
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", dict(params), prefix="conv.")
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    train(net, trainer, x[mine], y[mine], BATCH)
    train(ref, gluon.Trainer(ref.collect_params(), "sgd", dict(params), kvstore=None), x, y, len(x))
    got = values(net)
    assert_same_everywhere(hvd, got)
    check_against_reference(hvd, got, values(ref))
