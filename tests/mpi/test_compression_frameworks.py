"""The communicating compressors (perseus.compression) through TensorFlow and Keras under mpirun: allreduce
eagerly and in tf.function, DistributedGradientTape, and the Keras DistributedOptimizer in model.fit.

References are computed locally from every rank's deterministic input, so the tests hold at any world size.
"""

import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

tf = pytest.importorskip("tensorflow")

import perseus.tensorflow as hvd  # noqa: E402
from perseus.compression import REDUCERS  # noqa: E402

pytestmark = pytest.mark.timeout(180)

MODES = ["eager", "function"]


def ranks():
    return range(hvd.size())


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


def assert_same_on_all_ranks(values, name):
    gathered = hvd.allgather(tf.constant(np.asarray(values, np.float32).reshape(1, -1)), name=f"same.{name}")
    for r in ranks():
        np.testing.assert_array_equal(gathered[r].numpy(), gathered[0].numpy(), err_msg=f"rank {r}")


def test_compression_namespaces_name_every_reducer():
    import perseus.keras as hvd_keras
    import perseus.tensorflow.keras as hvd_tf_keras

    for namespace in (hvd.Compression, hvd_tf_keras.Compression, hvd_keras.Compression):
        for name, cls in REDUCERS.items():
            assert getattr(namespace, name) is cls, name
        assert namespace.none is hvd.Compression.none and namespace.fp16 is hvd.Compression.fp16


@pytest.mark.parametrize("mode", MODES)
def test_allreduce_topk_matches_reference_over_two_steps(mode):
    """Two steps under one name: the second uses the residual the first left (the key is stable, eagerly and
    in a traced function)."""
    density, n = 0.25, 40
    comp = hvd.Compression.topk(density)
    fn = (lambda t: hvd.allreduce(t, name="topk.two_steps", compression=comp)) if mode == "eager" else \
        tf.function(lambda t: hvd.allreduce(t, compression=comp))
    residuals = [np.zeros(n, np.float32) for _ in ranks()]
    for step in range(2):
        got = fn(tf.constant(rank_vector(hvd.rank(), n, seed=step)))
        assert got.dtype == tf.float32 and got.shape == (n,)
        ref = np.zeros(n, np.float64)
        for r in ranks():
            sent, residuals[r] = topk_sparse(residuals[r] + rank_vector(r, n, seed=step), density)
            ref += sent
        np.testing.assert_allclose(got.numpy(), ref / hvd.size(), rtol=1e-5, atol=1e-6)
        assert_same_on_all_ranks(got.numpy(), f"two_steps.{mode}.{step}")
    assert len(comp._states) == 1
    np.testing.assert_allclose(comp.residual(next(iter(comp._states))), residuals[hvd.rank()], rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_allreduce_topk_full_density_dtypes_sum_and_scale(mode):
    comp = hvd.Compression.topk(1.0)
    for dtype in (tf.float16, tf.bfloat16, tf.float64):
        x = tf.cast(tf.constant(rank_vector(hvd.rank(), 12, seed=3).reshape(3, 4)), dtype)

        def f(t, dtype=dtype):
            return hvd.allreduce(t, name=f"full.{dtype.name}", compression=comp, op=hvd.Sum, prescale_factor=0.5,
                                 postscale_factor=4.0)
        got = f(x) if mode == "eager" else tf.function(f)(x)
        assert got.dtype == dtype and got.shape == (3, 4)
        ref = sum(tf.cast(tf.cast(rank_vector(r, 12, seed=3), dtype), tf.float64).numpy() for r in ranks()) * 2.0
        np.testing.assert_allclose(tf.cast(got, tf.float64).numpy().ravel(), ref,
                                   rtol=1e-2 if dtype != tf.float64 else 1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_grouped_allreduce_and_indexed_slices_with_topk(mode):
    comp = hvd.Compression.topk(1.0)
    a = tf.constant(rank_vector(hvd.rank(), 6, seed=4))
    b = tf.constant(rank_vector(hvd.rank(), 4, seed=5).reshape(2, 2))
    rows = tf.constant(np.full((1, 3), hvd.rank() + 1.0, np.float32))

    def f(a, b, rows):
        outs = hvd.grouped_allreduce([a, b], compression=comp, name="grouped.topk")
        dense = hvd.allreduce(tf.IndexedSlices(rows, tf.constant([1]), tf.constant([3, 3])), compression=comp,
                              name="slices.topk", op=hvd.Sum)
        assert not isinstance(dense, tf.IndexedSlices)
        return outs + [dense]
    outs = f(a, b, rows) if mode == "eager" else tf.function(f)(a, b, rows)
    np.testing.assert_allclose(outs[0].numpy(), np.mean([rank_vector(r, 6, seed=4) for r in ranks()], 0),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outs[1].numpy().ravel(), np.mean([rank_vector(r, 4, seed=5) for r in ranks()], 0),
                               rtol=1e-5, atol=1e-6)
    want = np.zeros((3, 3), np.float32)
    want[1] = sum(r + 1.0 for r in ranks())
    np.testing.assert_array_equal(outs[2].numpy(), want)
    assert set(comp._states) == {"grouped.topk", "slices.topk"}


def test_allreduce_topk_needs_a_name_eagerly():
    with pytest.raises(ValueError, match="name"):
        hvd.allreduce(tf.ones([3]), compression=hvd.Compression.topk(0.5))
    with pytest.raises(ValueError, match="floating-point"):
        hvd.allreduce(tf.ones([3], tf.int32), name="ints", compression=hvd.Compression.topk(0.5))


def test_tf1_session_runs_more_compressed_reductions_than_threads():
    """Independent compressed reductions in one TF1 session.run on a single inter-op thread (no program order
    between them, so ranks may run their enqueues in different orders): none may hold the thread while it
    waits for the peers."""
    import shutil

    from perseus.tensorflow import _await
    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the await op cannot be built here")
    assert _await.load() is not None
    comp = hvd.Compression.topk(1.0)
    r, n = hvd.rank(), hvd.size()
    graph = tf.Graph()
    with graph.as_default():
        outs = [hvd.allreduce(tf.fill([3 + i], float(r + i)), op=hvd.Sum, compression=comp) for i in range(10)]
        config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1, intra_op_parallelism_threads=1)
        with tf.compat.v1.Session(graph=graph, config=config) as sess:
            for _ in range(2):
                values = sess.run(outs)
    for i, v in enumerate(values):
        np.testing.assert_allclose(v, np.full(3 + i, sum(k + i for k in range(n))))
    assert len(comp._states) == 10


# -- DistributedGradientTape ---------------------------------------------------------------------------------
def _problem(batch_per_rank=4):
    rng = np.random.default_rng(99)
    n = hvd.size()
    X = rng.standard_normal((n * batch_per_rank, 6)).astype(np.float32)
    Y = rng.standard_normal((n * batch_per_rank, 3)).astype(np.float32)
    return X, Y, rng.standard_normal((6, 3)).astype(np.float32), rng.standard_normal((3,)).astype(np.float32)


def _train(X, Y, W0, b0, compression, in_function, steps=4, lr=0.1, groups=None):
    W, b = tf.Variable(W0, name="tape_W"), tf.Variable(b0, name="tape_b")

    def step(X, Y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.matmul(X, W) + b - Y))
        tape = hvd.DistributedGradientTape(tape, compression=compression, groups=groups)
        gW, gb = tape.gradient(loss, [W, b])
        W.assign_sub(lr * gW)
        b.assign_sub(lr * gb)
    if in_function:
        step = tf.function(step)
    B = len(X) // hvd.size()
    me = hvd.rank()
    for _ in range(steps):
        step(tf.constant(X[me * B:(me + 1) * B]), tf.constant(Y[me * B:(me + 1) * B]))
    return np.concatenate([W.numpy().ravel(), b.numpy()])


@pytest.mark.parametrize("in_function", [False, True], ids=["eager", "function"])
def test_gradient_tape_topk(in_function):
    X, Y, W0, b0 = _problem()
    comp = hvd.Compression.topk(0.2)
    sparse = _train(X, Y, W0, b0, comp, in_function)
    assert_same_on_all_ranks(sparse, f"tape.topk.{in_function}")
    # one residual per variable, keyed by the variable's name
    assert sorted(comp._states) == ["DistributedGradientTape.tape_W", "DistributedGradientTape.tape_b"]
    full = _train(X, Y, W0, b0, hvd.Compression.topk(1.0), in_function)
    plain = _train(X, Y, W0, b0, hvd.Compression.none, in_function)
    assert_same_on_all_ranks(full, f"tape.full.{in_function}")
    np.testing.assert_allclose(full, plain, rtol=1e-5, atol=1e-6)
    assert not np.allclose(sparse, plain, rtol=1e-5, atol=1e-6)


#: how to build each compressor for a small test; a REDUCERS entry missing here is built without arguments
FACTORIES = {
    "topk": lambda c: c(0.3), "hitopk": lambda c: c(0.3), "randomk": lambda c: c(0.3),
    "cupcake": lambda c: c(REDUCERS["topk"](0.3)),
}


def build(name):
    cls = REDUCERS[name]
    try:
        return FACTORIES.get(name, lambda c: c())(cls)
    except TypeError as exc:
        pytest.fail(f"Compression.{name} cannot be built with its test factory or without arguments "
                    f"({exc}): add an entry to FACTORIES")


@pytest.mark.parametrize("in_function", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("name", sorted(REDUCERS))
def test_gradient_tape_every_compressor_keeps_ranks_identical(name, in_function):
    X, Y, W0, b0 = _problem()
    start = np.concatenate([W0.ravel(), b0])
    got = _train(X, Y, W0, b0, build(name), in_function, steps=3)
    assert np.isfinite(got).all() and not np.array_equal(got, start)
    assert_same_on_all_ranks(got, f"tape.every.{name}.{in_function}")


def test_gradient_tape_topk_groups():
    X, Y, W0, b0 = _problem()
    comp = hvd.Compression.topk(1.0)
    grouped = _train(X, Y, W0, b0, comp, True, groups=1)
    assert len(comp._states) == 1
    plain = _train(X, Y, W0, b0, hvd.Compression.none, True)
    np.testing.assert_allclose(grouped, plain, rtol=1e-5, atol=1e-6)


# -- Keras ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("passes", [1, 2], ids=["every_step", "aggregated"])
def test_keras_fit_with_topk_keeps_ranks_identical(passes):
    keras = pytest.importorskip("keras")
    import perseus.tensorflow.keras as hvd_keras

    rng = np.random.RandomState(7)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    model.set_weights([rng.uniform(-0.5, 0.5, w.shape).astype("float32") for w in model.get_weights()])
    comp = hvd_keras.Compression.topk(0.1)
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                                           compression=comp, backward_passes_per_step=passes),
                  loss="mse")
    data = np.random.RandomState(100 + hvd.rank())
    x, y = data.randn(32, 5).astype("float32"), data.randn(32, 1).astype("float32")
    start = np.concatenate([w.ravel() for w in model.get_weights()])
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    weights = np.concatenate([w.ravel() for w in model.get_weights()])
    assert_same_on_all_ranks(weights, f"keras.fit.topk.{passes}")
    assert not np.array_equal(weights, start)
    assert len(comp._states) == len(model.trainable_weights)
    assert all(k.startswith("DistributedSGD.") for k in comp._states)
    # momentum correction engaged (the default for SGD with top-k): the optimizer's own momentum stays unused
    opt = model.optimizer
    assert opt.momentum == 0.9
    assert all(not np.any(m.numpy()) for m in opt.momentums)


# -- Keras: momentum correction ------------------------------------------------------------------------------
MC_FEATURES, MC_BATCH, MC_LR, MC_MOMENTUM = 40, 8, 0.05, 0.9


def _linear_data(steps):
    """Every rank's batches (rank, step, batch, feature) of a linear regression, and the initial weights."""
    rng = np.random.default_rng(55)
    X = rng.standard_normal((hvd.size(), steps, MC_BATCH, MC_FEATURES)).astype(np.float32)
    Y = rng.standard_normal((hvd.size(), steps, MC_BATCH, 1)).astype(np.float32)
    return X, Y, rng.uniform(-0.3, 0.3, (MC_FEATURES, 1)).astype(np.float32), np.array([0.1], np.float32)


def _keras_linear(compression, steps, nesterov=False, eager=False):
    """This rank's training of ``Dense(1)`` under the mean squared error, SGD(MC_LR, MC_MOMENTUM), one batch
    per step; returns the flat weights and the optimizer."""
    import keras
    import perseus.tensorflow.keras as hvd_keras

    X, Y, W0, b0 = _linear_data(steps)
    model = keras.Sequential([keras.Input((MC_FEATURES,)), keras.layers.Dense(1)])
    model.set_weights([W0, b0])
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(MC_LR, momentum=MC_MOMENTUM, nesterov=nesterov),
                                         compression=compression)
    model.compile(optimizer=opt, loss="mse", run_eagerly=eager)
    for t in range(steps):
        model.train_on_batch(X[hvd.rank(), t], Y[hvd.rank(), t])
    return np.concatenate([w.ravel() for w in model.get_weights()]), model.optimizer


def _sparsify(v, density):
    """What top-k sends of ``v`` (flat; the residual keeps the rest) and the indices sent; every entry (None)
    when top-k sends the vector whole (every entry, or a payload no smaller than the vector)."""
    from perseus.compression.base import CHECK_LEN
    n = v.size
    k = max(1, min(n, math.ceil(density * n)))
    if k == n or 2 * k + 1 >= n + CHECK_LEN:
        return v.copy(), None
    idx = np.argsort(-np.abs(v), kind="stable")[:k]
    sent = np.zeros_like(v)
    sent[idx] = v[idx]
    return sent, idx


def _linear_reference(steps, density, nesterov, corrected):
    """NumPy (float64) training of :func:`_keras_linear` with top-k at ``density``: with momentum correction
    (velocity per rank before the compression, masked where sent, plain SGD on the average) or without (top-k
    of the gradient, Keras' momentum on the average)."""
    X, Y, W0, b0 = _linear_data(steps)
    m, n_ranks = MC_MOMENTUM, hvd.size()
    params = {"W": W0.astype(np.float64).ravel(), "b": b0.astype(np.float64)}
    velocity = {(r, k): None for r in ranks() for k in params}
    residual = {(r, k): np.zeros_like(p) for r in ranks() for k, p in params.items()}
    keras_velocity = {k: np.zeros_like(p) for k, p in params.items()}
    for t in range(steps):
        grads = {}
        for r in ranks():
            x, y = X[r, t].astype(np.float64), Y[r, t, :, 0].astype(np.float64)
            err = 2.0 * (x @ params["W"] + params["b"][0] - y) / MC_BATCH
            grads[r] = {"W": x.T @ err, "b": np.array([err.sum()])}
        for k in params:
            total = np.zeros_like(params[k])
            for r in ranks():
                g, u = grads[r][k], velocity[r, k]
                if corrected:
                    u = velocity[r, k] = g.copy() if u is None else m * u + g
                    residual[r, k] += g + m * u if nesterov else u
                else:
                    residual[r, k] += g
                sent, idx = _sparsify(residual[r, k], density)
                residual[r, k] = residual[r, k] - sent
                if corrected and idx is not None:
                    u[idx] = 0.0
                total += sent
            avg = total / n_ranks
            if corrected:
                params[k] -= MC_LR * avg
            else:
                keras_velocity[k] = m * keras_velocity[k] - MC_LR * avg
                params[k] += m * keras_velocity[k] - MC_LR * avg if nesterov else keras_velocity[k]
    return np.concatenate([params["W"], params["b"]])


def _momentum_slots_untouched(opt):
    return all(not np.any(v.numpy()) for v in opt.momentums)


@pytest.mark.parametrize("nesterov", [False, True], ids=["momentum", "nesterov"])
def test_keras_momentum_correction_at_full_density_is_momentum_sgd(nesterov):
    pytest.importorskip("keras")
    steps = 4
    full, opt = _keras_linear(hvd.Compression.topk(1.0), steps, nesterov)
    dense, dense_opt = _keras_linear(hvd.Compression.none, steps, nesterov)
    assert_same_on_all_ranks(full, f"keras.mc.full.{nesterov}")
    np.testing.assert_allclose(full, dense, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(full, _linear_reference(steps, 1.0, nesterov, True), rtol=1e-4, atol=1e-5)
    # the compressor applied the momentum: the optimizer's own slots were never written
    assert _momentum_slots_untouched(opt) and not _momentum_slots_untouched(dense_opt)
    assert opt.momentum == MC_MOMENTUM and opt.nesterov == nesterov


@pytest.mark.parametrize("nesterov,eager", [(False, False), (True, True)], ids=["function", "eager_nesterov"])
def test_keras_momentum_correction_matches_reference(nesterov, eager):
    pytest.importorskip("keras")
    steps, density = 3, 0.1
    comp = hvd.Compression.topk(density)
    got, opt = _keras_linear(comp, steps, nesterov, eager)
    assert_same_on_all_ranks(got, f"keras.mc.sparse.{nesterov}.{eager}")
    np.testing.assert_allclose(got, _linear_reference(steps, density, nesterov, True), rtol=1e-4, atol=1e-5)
    assert not np.allclose(got, _linear_reference(steps, density, nesterov, False), rtol=1e-4, atol=1e-5)
    assert _momentum_slots_untouched(opt)


def test_keras_momentum_correction_off_keeps_the_optimizers_momentum():
    pytest.importorskip("keras")
    steps, density = 3, 0.1
    comp = hvd.Compression.topk(density, momentum_correction=False)
    got, opt = _keras_linear(comp, steps)
    assert_same_on_all_ranks(got, "keras.mc.off")
    np.testing.assert_allclose(got, _linear_reference(steps, density, False, False), rtol=1e-4, atol=1e-5)
    assert not np.allclose(got, _linear_reference(steps, density, False, True), rtol=1e-4, atol=1e-5)
    assert not _momentum_slots_untouched(opt)
    assert all("velocity" not in st.extra for st in comp._states.values())
