"""DistributedOptimizer(op=hvd.Adasum) and DistributedTrainer(op=hvd.Adasum): each rank's own update, the
ranks' updates combined with Adasum. Checked against every rank's optimizer simulated in this process (its
own momentum or Adam moments, its own gradients) and the Adasum formula; every rank ends identical."""

import mxnet as mx
import numpy as np
import pytest
from mxnet import gluon

from test_training import FEATURES, assert_same_everywhere, make_net, values

pytestmark = pytest.mark.timeout(180)

STEPS = 3


def pair(a, b):
    ab, aa, bb = a @ b, a @ a, b @ b
    return (1 - ab / (2 * aa)) * a + (1 - ab / (2 * bb)) * b


def adasum(vectors):
    """Adasum over the ranks as the engine combines them: ranks past the largest power of two fold into the
    first ones, then a binary tree."""
    p2 = 1
    while p2 * 2 <= len(vectors):
        p2 *= 2
    folded = list(vectors[:p2])
    for i in range(len(vectors) - p2):
        folded[i] = pair(folded[i], vectors[p2 + i])

    def tree(x):
        return x[0] if len(x) == 1 else pair(tree(x[:len(x) // 2]), tree(x[len(x) // 2:]))
    return tree(folded)


def combine(starts, locals_):
    """start + Adasum of every rank's update, tensor by tensor (as float64, like the check)."""
    return [s + adasum([(l[i] - s).astype(np.float64).ravel() for l in locals_]).reshape(s.shape)
            for i, s in enumerate(starts)]


def grads_of(rank, step, shapes):
    rng = np.random.default_rng(100 * step + rank)
    return [rng.normal(size=s).astype(np.float32) for s in shapes]


@pytest.mark.parametrize("optimizer", [dict(name="sgd", learning_rate=0.1, momentum=0.9, wd=1e-3),
                                       dict(name="adam", learning_rate=0.01)])
def test_distributed_optimizer_combines_each_ranks_update(hvd, optimizer):
    rank, size = hvd.rank(), hvd.size()
    shapes = [(3, 4), (5,)]
    params = {k: v for k, v in optimizer.items() if k != "name"}
    opt = hvd.DistributedOptimizer(mx.optimizer.create(optimizer["name"], **params), op=hvd.Adasum)
    weights = [mx.nd.array(np.linspace(-1, 1, int(np.prod(s))).reshape(s)) for s in shapes]
    states = [opt.create_state(i, w) for i, w in enumerate(weights)]
    # every rank's optimizer, simulated here
    sims = [mx.optimizer.create(optimizer["name"], **params) for _ in range(size)]
    sim_states = [[o.create_state(i, w.copy()) for i, w in enumerate(weights)] for o in sims]
    expected = [w.asnumpy().astype(np.float64) for w in weights]
    for step in range(STEPS):
        mine = grads_of(rank, step, shapes)
        if step % 2 == 0 or optimizer["name"] != "sgd":  # one index at a time, or MXNet's aggregated form (SGD)
            for i, (w, g, s) in enumerate(zip(weights, mine, states)):
                opt.update(i, w, mx.nd.array(g), s)
        else:
            opt.update_multi_precision([0, 1], weights, [mx.nd.array(g) for g in mine], states)
        local = []
        for r in range(size):
            ws = [mx.nd.array(e.astype(np.float32)) for e in expected]
            for i, (w, g) in enumerate(zip(ws, grads_of(r, step, shapes))):
                sims[r].update(i, w, mx.nd.array(g), sim_states[r][i])
            local.append([w.asnumpy() for w in ws])
        expected = combine([e.astype(np.float32) for e in expected], local)
        for i, w in enumerate(weights):
            np.testing.assert_allclose(w.asnumpy(), expected[i], rtol=2e-5, atol=2e-6, err_msg=f"step {step} w{i}")
        expected = [w.asnumpy().astype(np.float64) for w in weights]  # the next step starts from the ranks' value
    assert_same_everywhere(hvd, {f"w{i}": w.asnumpy() for i, w in enumerate(weights)})


def test_distributed_trainer_combines_each_ranks_update(hvd):
    rank, size = hvd.rank(), hvd.size()
    mx.random.seed(5)
    net = make_net()
    net.initialize(mx.init.Xavier())
    hvd.broadcast_parameters(net.collect_params(), root_rank=0, prefix="adasum_trainer.")
    trainer = hvd.DistributedTrainer(net.collect_params(), "adam", {"learning_rate": 0.01}, op=hvd.Adasum,
                                     prefix="adasum_trainer.")
    sims = []
    for _ in range(size):  # every rank's plain trainer, simulated here
        sim = make_net()
        sim.initialize()
        sims.append((sim, gluon.Trainer(sim.collect_params(), "adam", {"learning_rate": 0.01}, kvstore=None)))
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    def batch(r, step):
        rng = np.random.default_rng(10 * step + r)
        return mx.nd.array(rng.normal(size=(4, FEATURES))), mx.nd.array(rng.integers(0, 3, size=4))

    for step in range(STEPS):
        start = [v.copy() for v in values(net).values()]
        x, y = batch(rank, step)
        with mx.autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        if step == 1:  # Gluon's split form: allreduce_grads leaves the gradients local, update does the step
            trainer.allreduce_grads()
            trainer.update(4)
        else:
            trainer.step(4)
        local = []
        for r, (sim, sim_trainer) in enumerate(sims):
            for p, s in zip(sim.collect_params().values(), start):
                p.set_data(mx.nd.array(s))
            x, y = batch(r, step)
            with mx.autograd.record():
                loss = loss_fn(sim(x), y)
            loss.backward()
            sim_trainer.step(4)
            local.append(list(values(sim).values()))
        expected = combine(start, local)
        for (k, got), want in zip(values(net).items(), expected):
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6, err_msg=f"step {step} {k}")
    assert_same_everywhere(hvd, values(net))


def test_adasum_arguments_are_checked(hvd):
    sgd = mx.optimizer.SGD(learning_rate=0.1)
    params = make_net().collect_params()
    with pytest.raises(NotImplementedError, match="not a communicating compressor"):
        hvd.DistributedOptimizer(sgd, op=hvd.Adasum, compression=hvd.Compression.topk(0.1))
    with pytest.raises(NotImplementedError, match="num_groups is not supported"):
        hvd.DistributedTrainer(params, "sgd", op=hvd.Adasum, num_groups=2)
    with pytest.raises(ValueError, match="gradient_predivide_factor not supported with op != Average"):
        hvd.DistributedOptimizer(sgd, op=hvd.Adasum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="op must be hvd.Average or hvd.Adasum, not hvd.Sum"):
        hvd.DistributedTrainer(params, "sgd", op=hvd.Sum)
