"""perseus.tensorflow DistributedOptimizer(op=Adasum) under mpirun: TF1 optimizers (graph and eager) and Keras
optimizers (Keras 3 and tf-keras 2; custom loops eagerly and in tf.function, and model.fit) combine every
rank's *update* by Adasum.

Each check simulates every rank on every rank: a plain (undistributed) copy of the optimizer per rank applies
that rank's own gradients from the common start, its update is ``delta_r = after - start``, and the expected
variables are ``start + Adasum(delta_0, ..., delta_{n-1})`` per variable, with the optimizers' state (momentum,
Adam's moments) kept per rank from step to step. Every rank must end equal to it, and to every other rank.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import perseus.keras as hvd_keras  # noqa: E402
import perseus.tensorflow as hvd  # noqa: E402
import perseus.tensorflow.keras as hvd_tf_keras  # noqa: E402

pytestmark = pytest.mark.timeout(240)

RTOL, ATOL = 2e-5, 1e-6


# -- the reference ------------------------------------------------------------------------------------------
def pair(a, b):
    """Adasum of two vectors: (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b (a zero vector's coefficient is 1)."""
    ab, aa, bb = float(a @ b), float(a @ a), float(b @ b)
    return (1 - ab / (2 * aa) if aa > 0 else 1.0) * a + (1 - ab / (2 * bb) if bb > 0 else 1.0) * b


def tree(vectors):
    if len(vectors) == 1:
        return vectors[0]
    half = len(vectors) // 2
    return pair(tree(vectors[:half]), tree(vectors[half:]))


def adasum(arrays):
    """The engine's combination of every rank's array (docs/adasum.md: ranks past the largest power of two
    fold into ranks 0, 1, ... first), in float64, in the arrays' shape."""
    shape = np.shape(arrays[0])
    vs = [np.asarray(a, np.float64).ravel() for a in arrays]
    p2 = 1
    while p2 * 2 <= len(vs):
        p2 *= 2
    head = vs[:p2]
    for i in range(len(vs) - p2):
        head[i] = pair(head[i], vs[p2 + i])
    return tree(head).reshape(shape)


def combine(start, deltas_per_rank):
    """``start + Adasum(deltas)`` for each variable: ``start`` a list of arrays, ``deltas_per_rank`` one such
    list per rank."""
    return [s + adasum([d[i] for d in deltas_per_rank]) for i, s in enumerate(start)]


def assert_discriminating(start, deltas_per_rank):
    """The check below tells Adasum from averaging: the expected step differs from the mean update."""
    ada = combine(start, deltas_per_rank)
    mean = [s + np.mean([d[i] for d in deltas_per_rank], axis=0) for i, s in enumerate(start)]
    assert max(float(np.abs(a - m).max()) for a, m in zip(ada, mean)) > 1e-4


def assert_same_on_all_ranks(values):
    flat = np.concatenate([np.ravel(v) for v in values]).astype(np.float64)
    gathered = hvd.allgather(tf.constant(flat[None])).numpy()
    for other in gathered[1:]:
        np.testing.assert_array_equal(other, gathered[0])


def assert_close(actual, expected):
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(np.asarray(a, np.float64), e, rtol=RTOL, atol=ATOL)


def call(mode, fn):
    return fn if mode == "eager" else tf.function(fn)


# -- data ---------------------------------------------------------------------------------------------------
def data(rank, samples=8, seed=1):
    """Rank ``rank``'s batch: different on every rank, so the updates are far from parallel."""
    rng = np.random.RandomState(seed * 1000 + rank)
    return rng.randn(samples, 5).astype("float32"), rng.randn(samples, 1).astype("float32") * (rank + 1)


def make_model(k=keras, seed=0):
    model = k.Sequential([k.Input((5,)), k.layers.Dense(4, activation="tanh"), k.layers.Dense(1)])
    rng = np.random.RandomState(seed)
    model.set_weights([rng.uniform(-0.5, 0.5, w.shape).astype("float32") for w in model.get_weights()])
    return model


def weights(model):
    return [np.asarray(w, np.float64) for w in model.get_weights()]


class Simulation:
    """Every rank's plain optimizer, each on its own copy of the model: :meth:`step` gives the expected
    common weights after one Adasum step from ``start``."""

    def __init__(self, make_opt, k=keras, loss=None):
        n = hvd.size()
        self.models = [make_model(k) for _ in range(n)]
        self.opts = [make_opt() for _ in range(n)]
        self.loss = loss or k.losses.MeanSquaredError()

    def deltas(self, start, batches_per_rank):
        """Each rank's update from ``start``: its optimizer applies the sum of its batches' gradients."""
        out = []
        for model, opt, batches in zip(self.models, self.opts, batches_per_rank):
            model.set_weights([s.astype("float32") for s in start])
            total = None
            for x, y in batches:
                with tf.GradientTape() as tape:
                    value = self.loss(y, model(x, training=True))
                grads = tape.gradient(value, model.trainable_variables)
                total = grads if total is None else [a + b for a, b in zip(total, grads)]
            opt.apply_gradients(zip(total, model.trainable_variables))
            out.append([w - s for w, s in zip(weights(model), start)])
        return out


def custom_step(model, opt, k=keras):
    loss_fn = k.losses.MeanSquaredError()

    def step(x, y):
        with tf.GradientTape() as tape:
            value = loss_fn(y, model(x, training=True))
        grads = tape.gradient(value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    return step


OPTIMIZERS = {"sgd_momentum": lambda k: k.optimizers.SGD(0.1, momentum=0.9),
              "adam": lambda k: k.optimizers.Adam(0.05)}


# -- Keras 3 ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_keras_custom_loop_combines_local_updates(kind, mode):
    r, n = hvd.rank(), hvd.size()
    make_opt = lambda: OPTIMIZERS[kind](keras)  # noqa: E731
    model = make_model()
    opt = hvd_tf_keras.DistributedOptimizer(make_opt(), op=hvd.Adasum)
    step = call(mode, custom_step(model, opt))
    sim = Simulation(make_opt)
    expected = weights(model)
    for s in range(3):  # the later steps use each rank's own optimizer state
        step(*data(r, seed=s))
        deltas = sim.deltas(expected, [[data(q, seed=s)] for q in range(n)])
        if s == 0:
            assert_discriminating(expected, deltas)
        expected = combine(expected, deltas)
        assert_close(weights(model), expected)
        assert_same_on_all_ranks(model.get_weights())


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_keras_model_fit_combines_local_updates(kind):
    r, n = hvd.rank(), hvd.size()
    make_opt = lambda: OPTIMIZERS[kind](keras)  # noqa: E731
    model = make_model()
    model.compile(optimizer=hvd_keras.DistributedOptimizer(make_opt(), op=hvd_keras.Adasum), loss="mse")
    x, y = data(r, samples=16)
    start = weights(model)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)  # two steps, in the compiled train_step
    sim = Simulation(make_opt)
    expected = start
    for half in (slice(0, 8), slice(8, 16)):
        batches = []
        for q in range(n):
            xq, yq = data(q, samples=16)
            batches.append([(xq[half], yq[half])])
        expected = combine(expected, sim.deltas(expected, batches))
    assert_close(weights(model), expected)
    assert_same_on_all_ranks(model.get_weights())


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_keras_backward_passes_sum_locally_then_combine(mode):
    """backward_passes_per_step=2: the first pass changes nothing; the second applies the sum of both passes'
    gradients locally and combines the updates."""
    r, n = hvd.rank(), hvd.size()
    make_opt = lambda: keras.optimizers.SGD(0.1, momentum=0.9)  # noqa: E731
    model = make_model()
    opt = hvd.DistributedOptimizer(make_opt(), op=hvd.Adasum, backward_passes_per_step=2)
    step = call(mode, custom_step(model, opt))
    start = weights(model)
    step(*data(r, seed=10))
    assert_close(weights(model), start)
    step(*data(r, seed=11))
    sim = Simulation(make_opt)
    expected = combine(start, sim.deltas(start, [[data(q, seed=10), data(q, seed=11)] for q in range(n)]))
    assert_close(weights(model), expected)
    assert_same_on_all_ranks(model.get_weights())


@pytest.mark.filterwarnings("ignore:Gradients do not exist")
def test_keras_none_gradient_is_a_zero_update_and_sparse_gradients_apply():
    """A variable without a gradient stays where it is on every rank (each rank still runs the same
    all-reduce); an embedding's tf.IndexedSlices gradient is applied locally and its dense update combined."""
    r, n = hvd.rank(), hvd.size()
    table = keras.Variable(np.arange(12, dtype="float32").reshape(6, 2) / 10, name="table")
    unused = keras.Variable(np.ones(3, "float32"), name="unused")
    dense = keras.Variable(np.array([0.5, -0.25], "float32"), name="dense")
    variables = [table, unused, dense]
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.5), op=hvd.Adasum)
    ids = [tf.constant([0, 2, 2]), tf.constant([1, 2, 5]), tf.constant([3, 4, 0])]

    def grads_of(q, values):
        with tf.GradientTape() as tape:
            rows = tf.gather(values[0], ids[q % len(ids)])
            loss = tf.reduce_sum(rows * values[2]) * (q + 1) + tf.reduce_sum(values[2] ** 2)
        return tape.gradient(loss, [values[0], values[1], values[2]])

    start = [np.asarray(v.numpy(), np.float64) for v in variables]
    grads = grads_of(r, [table, unused, dense])
    assert isinstance(grads[0], tf.IndexedSlices) and grads[1] is None
    opt.apply_gradients(zip(grads, variables))
    deltas = []
    for q in range(n):
        g = grads_of(q, [tf.Variable(s.astype("float32")) for s in start])
        deltas.append([-0.5 * tf.convert_to_tensor(g[0]).numpy(), np.zeros(3), -0.5 * g[2].numpy()])
    assert_close([v.numpy() for v in variables], combine(start, deltas))
    np.testing.assert_array_equal(unused.numpy(), np.ones(3))
    assert_same_on_all_ranks([v.numpy() for v in variables])


def test_outside_the_process_set_the_step_is_local():
    """A process set of rank 0 alone: rank 0 (a set of one) and the ranks outside it take their own plain
    step, with no collective."""
    r = hvd.rank()
    solo = hvd.add_process_set([0])
    try:
        make_opt = lambda: keras.optimizers.Adam(0.05)  # noqa: E731
        model = make_model()
        opt = hvd.DistributedOptimizer(make_opt(), op=hvd.Adasum, process_set=solo)
        start = weights(model)
        custom_step(model, opt)(*data(r))
        sim = Simulation(make_opt)
        mine = sim.deltas(start, [[data(r)]] * hvd.size())[0]  # (every simulated rank on this rank's data)
        assert_close(weights(model), [s + d for s, d in zip(start, mine)])
    finally:
        hvd.remove_process_set(solo)


def test_keras_local_layers_keep_their_local_update():
    """PartialDistributedOptimizer(op=Adasum): the local layer takes this rank's own step (its gradient divided
    by the number of ranks, scale_local_gradients), the other layer the combined one."""
    r, n = hvd.rank(), hvd.size()
    lr = 0.1
    model = make_model()
    local_layer = model.layers[1]
    opt = hvd_tf_keras.PartialDistributedOptimizer(keras.optimizers.SGD(lr), local_layers=[local_layer],
                                                   op=hvd.Adasum)
    start = weights(model)
    custom_step(model, opt)(*data(r, seed=3))
    grads = []
    for q in range(n):
        sim = make_model()
        x, y = data(q, seed=3)
        with tf.GradientTape() as tape:
            value = keras.losses.MeanSquaredError()(y, sim(x, training=True))
        grads.append([np.asarray(g, np.float64) for g in tape.gradient(value, sim.trainable_variables)])
    shared = combine(start[:2], [[-lr * g for g in gq[:2]] for gq in grads])
    local = [s - lr * g / n for s, g in zip(start[2:], grads[r][2:])]
    assert_close(weights(model), shared + local)
    assert_same_on_all_ranks(model.get_weights()[:2])


# -- tf-keras 2 ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["sgd_momentum", "legacy_adam"])
def test_tf_keras2_fit_combines_local_updates(kind):
    tf_keras = pytest.importorskip("tf_keras")
    r, n = hvd.rank(), hvd.size()
    make_opt = (lambda: tf_keras.optimizers.SGD(0.1, momentum=0.9)) if kind == "sgd_momentum" else \
        (lambda: tf_keras.optimizers.legacy.Adam(0.05))
    model = make_model(tf_keras)
    model.compile(optimizer=hvd.DistributedOptimizer(make_opt(), op=hvd.Adasum), loss="mse")
    x, y = data(r, samples=16)
    start = weights(model)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    sim = Simulation(make_opt, tf_keras)
    expected = start
    for half in (slice(0, 8), slice(8, 16)):
        batches = []
        for q in range(n):
            xq, yq = data(q, samples=16)
            batches.append([(xq[half], yq[half])])
        expected = combine(expected, sim.deltas(expected, batches))
    assert_close(weights(model), expected)
    assert_same_on_all_ranks(model.get_weights())


# -- TF1 ----------------------------------------------------------------------------------------------------
def tf1_problem(q):
    """Rank q's quadratic loss 0.5 sum(a w^2) + sum(b w) over two variables: gradient a w + b."""
    rng = np.random.RandomState(50 + q)
    return [(rng.uniform(0.5, 2.0, 3), rng.randn(3) * (q + 1)), (rng.uniform(0.5, 2.0, 2), rng.randn(2))]


def test_tf1_graph_momentum_in_a_session():
    r, n = hvd.rank(), hvd.size()
    lr, m = float(np.float32(0.1)), float(np.float32(0.9))  # (TF1 keeps the hyperparameters in float32)
    init = [np.array([1.0, -2.0, 0.5]), np.array([0.25, 3.0])]
    graph = tf.Graph()
    with graph.as_default():
        ws = [tf.compat.v1.get_variable(f"w{i}", initializer=tf.constant(v), use_resource=True)
              for i, v in enumerate(init)]
        idle = tf.compat.v1.get_variable("idle", initializer=tf.constant([7.0, 8.0], tf.float64), use_resource=True)
        loss = tf.add_n([tf.reduce_sum(0.5 * a * w * w + b * w) for (a, b), w in zip(tf1_problem(r), ws)])
        gs = tf.compat.v1.train.get_or_create_global_step()
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.MomentumOptimizer(lr, m), op=hvd.Adasum)
        assert isinstance(opt, tf.compat.v1.train.Optimizer)
        grads = opt.compute_gradients(loss, var_list=ws + [idle])
        train = opt.apply_gradients(grads, global_step=gs)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            local_grads = sess.run([g for g, _ in grads[:2]])
            results = []
            for _ in range(3):
                sess.run(train)
                results.append(sess.run(ws + [idle, gs]))
    # the gradients are this rank's own, not averaged
    for g, (a, b), w in zip(local_grads, tf1_problem(r), init):
        np.testing.assert_allclose(g, a * w + b, rtol=1e-12)
    expected = [w.copy() for w in init]
    velocity = [[np.zeros_like(w) for w in init] for _ in range(n)]
    for step, got in enumerate(results):
        deltas = []
        for q in range(n):
            d = []
            for i, ((a, b), w) in enumerate(zip(tf1_problem(q), expected)):
                velocity[q][i] = m * velocity[q][i] + (a * w + b)
                d.append(-lr * velocity[q][i])
            deltas.append(d)
        if step == 0:
            assert_discriminating(expected, deltas)
        expected = combine(expected, deltas)
        for actual, e in zip(got[:2], expected):
            np.testing.assert_allclose(actual, e, rtol=1e-10, atol=1e-12)
        np.testing.assert_array_equal(got[2], [7.0, 8.0])
        assert got[3] == step + 1
        assert_same_on_all_ranks(got[:2])


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_tf1_optimizer_eagerly_and_in_tf_function(mode):
    """A TF1 Adam through ``minimize`` (eagerly) or ``apply_gradients`` (in a tf.function), against every
    rank's plain TF1 Adam."""
    r, n = hvd.rank(), hvd.size()
    init = [np.array([1.0, -2.0, 0.5]), np.array([0.25, 3.0])]
    make_opt = lambda: tf.compat.v1.train.AdamOptimizer(0.05)  # noqa: E731

    def loss_of(q, ws):
        return lambda: tf.add_n([tf.reduce_sum(0.5 * a * w * w + b * w) for (a, b), w in zip(tf1_problem(q), ws)])

    ws = [tf.Variable(v) for v in init]
    opt = hvd.DistributedOptimizer(make_opt(), op=hvd.Adasum)
    if mode == "eager":
        def step():
            opt.minimize(loss_of(r, ws), var_list=ws)
    else:
        @tf.function
        def step():
            with tf.GradientTape() as tape:
                value = loss_of(r, ws)()
            opt.apply_gradients(zip(tape.gradient(value, ws), ws))
    sims = [([tf.Variable(v) for v in init], make_opt()) for _ in range(n)]
    expected = [w.copy() for w in init]
    for _ in range(3):
        step()
        deltas = []
        for q, (sws, sopt) in enumerate(sims):
            for sw, e in zip(sws, expected):
                sw.assign(e)
            sopt.minimize(loss_of(q, sws), var_list=sws)
            deltas.append([sw.numpy() - e for sw, e in zip(sws, expected)])
        expected = combine(expected, deltas)
        for w, e in zip(ws, expected):
            np.testing.assert_allclose(w.numpy(), e, rtol=1e-10, atol=1e-12)
        assert_same_on_all_ranks([w.numpy() for w in ws])


# -- errors -------------------------------------------------------------------------------------------------
def test_options_adasum_cannot_honour_are_refused():
    tf1 = lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1)  # noqa: E731
    sgd = lambda: keras.optimizers.SGD(0.1)  # noqa: E731
    for wrap in (hvd.DistributedOptimizer, hvd_tf_keras.DistributedOptimizer):
        for make in ((tf1, sgd) if wrap is hvd.DistributedOptimizer else (sgd,)):
            with pytest.raises(NotImplementedError, match="communicating compressor"):
                wrap(make(), op=hvd.Adasum, compression=hvd.Compression.topk(0.1))
            with pytest.raises(NotImplementedError, match="groups"):
                wrap(make(), op=hvd.Adasum, groups=2)
            with pytest.raises(ValueError, match="gradient_predivide_factor not supported with op != Average"):
                wrap(make(), op=hvd.Adasum, gradient_predivide_factor=2.0)
    with pytest.raises(NotImplementedError, match="backward_passes_per_step"):
        hvd.DistributedOptimizer(tf1(), op=hvd.Adasum, backward_passes_per_step=2)
    with pytest.raises(NotImplementedError, match="use_ema"):
        hvd.DistributedOptimizer(keras.optimizers.Adam(0.1, use_ema=True), op=hvd.Adasum)
    with pytest.raises(ValueError, match="Average, op=Sum or op=Adasum"):
        hvd.DistributedOptimizer(sgd(), op=hvd.Min)
    # fp16 on the wire is accepted
    hvd.DistributedOptimizer(sgd(), op=hvd.Adasum, compression=hvd.Compression.fp16)
