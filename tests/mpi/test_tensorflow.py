"""perseus.tensorflow under mpirun: every collective eagerly and in tf.function, gradients, errors, the tape.

References are built locally from every rank's deterministic input (conftest.rank_data), so the tests hold at
any world size.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import perseus.tensorflow as hvd  # noqa: E402
from conftest import rank_data  # noqa: E402

pytestmark = pytest.mark.timeout(120)

DTYPES = ["uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64", "bool"]
FLOATS = ["float16", "bfloat16", "float32", "float64"]
MODES = ["eager", "function"]


def tens(r, shape, dtype, seed=0):
    a = np.asarray(rank_data(r, shape, dtype, seed))
    if dtype == "bfloat16":
        return tf.cast(tf.constant(a), tf.bfloat16)
    return tf.constant(a, dtype=tf.as_dtype(dtype))


def as_np(t):
    t = tf.convert_to_tensor(t)
    return t.numpy() if t.dtype == tf.bool else tf.cast(t, tf.float64).numpy()


def call(mode, fn, *args):
    if mode == "eager":
        return fn(*args)
    return tf.function(fn)(*args)


def reduce_ref(arrays, op):
    stack = np.stack(arrays)
    if stack.dtype == bool:
        return {hvd.Sum: stack.any(0), hvd.Max: stack.any(0), hvd.Min: stack.all(0)}[op]
    return {hvd.Sum: stack.sum(0), hvd.Average: stack.mean(0), hvd.Min: stack.min(0), hvd.Max: stack.max(0),
            hvd.Product: stack.prod(0)}[op]


def ranks():
    return range(hvd.size())


# -- basics ------------------------------------------------------------------------------------------------
def test_basics_and_ops():
    from mpi4py import MPI

    hvd.init()  # already initialised by conftest through perseus.torch: a no-op
    assert hvd.is_initialized()
    assert hvd.size() == MPI.COMM_WORLD.Get_size() and hvd.rank() == MPI.COMM_WORLD.Get_rank()
    assert hvd.mpi_ops._basics.size() == hvd.size()
    assert hvd._check_has_gpu() is False and hvd.gpu_available("tensorflow") is False
    assert hvd._executing_eagerly() and hvd.util._executing_eagerly()
    assert int(hvd.size_op()) == hvd.size() and int(hvd.rank_op()) == hvd.rank()
    assert int(hvd.local_size_op()) == hvd.local_size() and int(hvd.local_rank_op()) == hvd.local_rank()
    assert int(hvd.process_set_included_op()) == 1

    @tf.function
    def f():
        assert not hvd._executing_eagerly()
        return hvd.size_op(), hvd.rank_op(), hvd.local_rank_op(), hvd.local_size_op()
    s, r, lr, ls = f()
    assert s.dtype == tf.int32 and (int(s), int(r), int(lr), int(ls)) == (hvd.size(), hvd.rank(),
                                                                          hvd.local_rank(), hvd.local_size())


# -- allreduce ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce(mode, dtype):
    ops = [hvd.Sum, hvd.Min, hvd.Max] + ([hvd.Average] if dtype in FLOATS else [])
    for i, op in enumerate(ops):
        for shape in [(), (17,), (3, 5, 2)]:
            x = tens(hvd.rank(), shape, dtype, seed=i)
            out = call(mode, lambda t: hvd.allreduce(t, op=op), x)
            assert out.dtype == x.dtype and out.shape == x.shape
            ref = reduce_ref([as_np(tens(r, shape, dtype, seed=i)) for r in ranks()], op)
            np.testing.assert_allclose(as_np(out), ref, rtol=1e-2 if dtype in ("float16", "bfloat16") else 1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_allreduce_scale_and_static_shape(mode):
    x = tens(hvd.rank(), (4, 3), "float32")
    out = call(mode, lambda t: hvd.allreduce(t, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0), x)
    ref = reduce_ref([as_np(tens(r, (4, 3), "float32")) for r in ranks()], hvd.Sum) * 1.5
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-6)

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32)])
    def f(t):
        y = hvd.allreduce(t)
        assert y.shape.as_list() == [None, 3]
        g = hvd.allgather(t)
        assert g.shape.as_list() == [None, 3]
        return y
    f(x)


@pytest.mark.parametrize("mode", MODES)
def test_grouped_allreduce_and_compression(mode):
    xs = [tens(hvd.rank(), s, d, seed=j) for j, (s, d) in enumerate([((5,), "float32"), ((2, 3), "float64"),
                                                                      ((4,), "int32")])]
    outs = call(mode, lambda a, b, c: hvd.grouped_allreduce([a, b, c], op=hvd.Sum), *xs)
    for j, (x, out) in enumerate(zip(xs, outs)):
        ref = reduce_ref([as_np(tens(r, x.shape, x.dtype.name, seed=j)) for r in ranks()], hvd.Sum)
        np.testing.assert_allclose(as_np(out), ref)
    for comp in (hvd.Compression.fp16, hvd.Compression.bf16):
        out = call(mode, lambda t: hvd.allreduce(t, compression=comp, op=hvd.Sum), xs[0])
        assert out.dtype == tf.float32
        np.testing.assert_allclose(out.numpy(), reduce_ref([as_np(tens(r, (5,), "float32")) for r in ranks()],
                                                           hvd.Sum))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_allreduce_indexed_slices(mode, op):
    op = getattr(hvd, op)

    def slices(r):
        return tf.IndexedSlices(tf.constant(rank_data(r, (2, 3), "float32")), tf.constant([r % 4, 3], tf.int64),
                                dense_shape=tf.constant([4, 3], tf.int64))

    def fn(v, i, d):
        out = hvd.allreduce(tf.IndexedSlices(v, i, d), op=op)
        assert isinstance(out, tf.IndexedSlices)
        return tf.convert_to_tensor(out)
    s = slices(hvd.rank())
    dense = call(mode, fn, s.values, s.indices, s.dense_shape)
    ref = sum(tf.convert_to_tensor(slices(r)).numpy() for r in ranks())
    if op == hvd.Average:
        ref = ref / hvd.size()
    np.testing.assert_allclose(dense.numpy(), ref, rtol=1e-6)


# -- allgather / broadcast / alltoall / reducescatter --------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_allgather(mode, dtype):
    x = tens(hvd.rank(), (hvd.rank() + 1, 3), dtype)
    out = call(mode, hvd.allgather, x)
    ref = np.concatenate([as_np(tens(r, (r + 1, 3), dtype)) for r in ranks()])
    np.testing.assert_array_equal(as_np(out), ref)
    scalar = call(mode, hvd.allgather, tens(hvd.rank(), (), dtype))
    np.testing.assert_array_equal(as_np(scalar), np.stack([as_np(tens(r, (), dtype)) for r in ranks()]))


@pytest.mark.parametrize("mode", MODES)
def test_grouped_allgather(mode):
    xs = [tens(hvd.rank(), (hvd.rank() + 1, 2), "float32"), tens(hvd.rank(), (2 * hvd.rank() + 1,), "int64", 1)]
    outs = call(mode, lambda a, b: hvd.grouped_allgather([a, b]), *xs)
    np.testing.assert_array_equal(outs[0].numpy(), np.concatenate([as_np(tens(r, (r + 1, 2), "float32"))
                                                                   for r in ranks()]))
    np.testing.assert_array_equal(outs[1].numpy(), np.concatenate([as_np(tens(r, (2 * r + 1,), "int64", 1))
                                                                   for r in ranks()]))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast(mode, dtype):
    for root in ranks():
        x = tens(hvd.rank(), (3, 4), dtype, seed=root)
        out = call(mode, lambda t: hvd.broadcast(t, root), x)
        np.testing.assert_array_equal(as_np(out), as_np(tens(root, (3, 4), dtype, seed=root)))


def test_broadcast_inplace_and_variables():
    root = hvd.size() - 1
    v1 = tf.Variable(tens(hvd.rank(), (3,), "float32"))
    v2 = tf.Variable(tens(hvd.rank(), (2, 2), "int32", 1))
    vals = hvd.broadcast_([v1, v2], root)
    np.testing.assert_array_equal(v1.numpy(), as_np(tens(root, (3,), "float32")))
    np.testing.assert_array_equal(vals[1].numpy(), as_np(tens(root, (2, 2), "int32", 1)))
    w = [tf.Variable(tens(hvd.rank(), (4,), "float64", 2)), tf.Variable(tens(hvd.rank(), (), "bfloat16", 3))]
    hvd.broadcast_variables(w, root_rank=0)
    np.testing.assert_array_equal(w[0].numpy(), as_np(tens(0, (4,), "float64", 2)))
    np.testing.assert_array_equal(as_np(w[1]), as_np(tens(0, (), "bfloat16", 3)))
    w2 = [tf.Variable(tens(hvd.rank(), (4,), "float32", 4))]

    @tf.function
    def bcast():
        hvd.broadcast_variables(w2, root_rank=root)
    bcast()
    np.testing.assert_array_equal(w2[0].numpy(), as_np(tens(root, (4,), "float32", 4)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["int32", "float32", "bfloat16", "bool"])
def test_alltoall(mode, dtype):
    n, me = hvd.size(), hvd.rank()

    def splits_of(r):
        return np.array([(r + j) % 3 for j in range(n)], np.int32)

    def rows(r, j):  # the rows rank r sends to rank j
        data = as_np(tens(r, (int(splits_of(r).sum()), 2), dtype))
        start = int(splits_of(r)[:j].sum())
        return data[start:start + splits_of(r)[j]]
    x = tens(me, (int(splits_of(me).sum()), 2), dtype)
    out, received = call(mode, lambda t, s: hvd.alltoall(t, splits=s), x, tf.constant(splits_of(me)))
    np.testing.assert_array_equal(as_np(out).reshape(-1, 2), np.concatenate([rows(r, me) for r in ranks()]))
    np.testing.assert_array_equal(received.numpy(), [splits_of(r)[me] for r in ranks()])
    even = tens(me, (2 * n, 3), dtype, seed=1)
    out = call(mode, hvd.alltoall, even)
    ref = np.concatenate([as_np(tens(r, (2 * n, 3), dtype, seed=1))[2 * me:2 * me + 2] for r in ranks()])
    np.testing.assert_array_equal(as_np(out), ref)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", ["Sum", "Average", "Max"])
def test_reducescatter(mode, op):
    op = getattr(hvd, op)
    n, me = hvd.size(), hvd.rank()
    rows = 2 * n + 1  # uneven: earlier ranks get one more row
    x = tens(me, (rows, 3), "float32")
    out = call(mode, lambda t: hvd.reducescatter(t, op=op), x)
    full = reduce_ref([as_np(tens(r, (rows, 3), "float32")) for r in ranks()], op)
    counts = [rows // n + (1 if r < rows % n else 0) for r in ranks()]
    start = sum(counts[:me])
    np.testing.assert_allclose(out.numpy(), full[start:start + counts[me]], rtol=1e-6)
    outs = call(mode, lambda a, b: hvd.grouped_reducescatter([a, b], op=op), x, x * 2)
    np.testing.assert_allclose(outs[1].numpy(), 2 * full[start:start + counts[me]], rtol=1e-6)


# -- gradients -----------------------------------------------------------------------------------------------
def grad_of(mode, fn, x):
    def g(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = fn(x)
        return tape.gradient(loss, x)
    return call(mode, g, x)


@pytest.mark.parametrize("mode", MODES)
def test_gradients(mode):
    n, me = hvd.size(), hvd.rank()
    w = float(me + 1)
    mean_w = np.mean([r + 1.0 for r in ranks()])
    x = tf.ones([2 * n, 3])
    g = grad_of(mode, lambda t: tf.reduce_sum(hvd.allreduce(t, op=hvd.Sum) * w), x)
    np.testing.assert_allclose(g.numpy(), np.full((2 * n, 3), mean_w * n))
    g = grad_of(mode, lambda t: tf.reduce_sum(hvd.allreduce(t) * w), x)
    np.testing.assert_allclose(g.numpy(), np.full((2 * n, 3), mean_w))
    g = grad_of(mode, lambda t: tf.reduce_sum(hvd.grouped_allreduce([t, t * 2], op=hvd.Sum)[1] * w), x)
    np.testing.assert_allclose(g.numpy(), np.full((2 * n, 3), 2 * mean_w * n))
    xg = tf.ones([me + 1, 2])
    g = grad_of(mode, lambda t: tf.reduce_sum(hvd.allgather(t) * w), xg)  # Horovod: average, then my rows
    np.testing.assert_allclose(g.numpy(), np.full((me + 1, 2), mean_w))
    g = grad_of(mode, lambda t: tf.reduce_sum(hvd.broadcast(t, 0) * w), x)
    np.testing.assert_allclose(g.numpy(), np.full((2 * n, 3), mean_w if me == 0 else 0.0))
    g = grad_of(mode, lambda t: tf.reduce_sum(hvd.alltoall(t) * w), x)
    np.testing.assert_allclose(g.numpy(), np.repeat(np.arange(1.0, n + 1), 2)[:, None] * np.ones((1, 3)))
    g = grad_of(mode, lambda t: tf.reduce_sum(hvd.reducescatter(t, op=hvd.Sum) * w), x)
    np.testing.assert_allclose(g.numpy(), n * np.repeat(np.arange(1.0, n + 1), 2)[:, None] * np.ones((1, 3)))
    g = grad_of(mode, lambda t: tf.reduce_sum(hvd.reducescatter(t, op=hvd.Average) * w), x)
    np.testing.assert_allclose(g.numpy(), np.repeat(np.arange(1.0, n + 1), 2)[:, None] * np.ones((1, 3)))


# -- errors --------------------------------------------------------------------------------------------------
def check_healthy():
    out = hvd.allreduce(tf.ones([2]), op=hvd.Sum, name="tf_after_error")
    assert out.numpy().tolist() == [hvd.size()] * 2


@pytest.mark.parametrize("mode", MODES)
def test_shape_mismatch_everywhere(mode):
    if hvd.size() == 1:
        pytest.skip("needs 2+ ranks")
    shape = (4, 3) if hvd.rank() == 0 else (4, 2)
    with pytest.raises(tf.errors.FailedPreconditionError) as info:
        call(mode, lambda t: hvd.allreduce(t, name=f"tf_mismatch_{mode}"), tf.ones(shape))
    if mode == "eager":
        assert "shape" in str(info.value) and isinstance(info.value, hvd.HorovodInternalError)
    check_healthy()
    dt = tf.float32 if hvd.rank() == 0 else tf.int32
    with pytest.raises(tf.errors.FailedPreconditionError):
        call(mode, lambda t: hvd.allgather(t, name=f"tf_mismatch_dt_{mode}"), tf.ones([2], dt))
    check_healthy()
    op = hvd.Sum if hvd.rank() == 0 else hvd.Max
    with pytest.raises(tf.errors.FailedPreconditionError):
        call(mode, lambda t: hvd.allreduce(t, op=op, name=f"tf_mismatch_op_{mode}"), tf.ones([2]))
    check_healthy()


def test_bad_arguments():
    with pytest.raises(ValueError, match="not supported"):
        hvd.allreduce(tf.ones([2], tf.complex64))
    with pytest.raises(ValueError, match="supersedes"):
        hvd.allreduce(tf.ones([2]), average=True, op=hvd.Sum)
    with pytest.raises(ValueError, match="bool"):
        hvd.allreduce(tf.ones([2], tf.bool))
    with pytest.raises(NotImplementedError):
        hvd.allreduce(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0])), op=hvd.Max)
    with pytest.raises(NotImplementedError, match="jit_compile"):
        tf.function(lambda t: hvd.allreduce(t), jit_compile=True)(tf.ones([2]))
    check_healthy()


def test_duplicate_name_in_flight_eager():
    # A name of this rank's own, submitted by no other rank before the MPI barrier: still in flight for sure
    # when the TensorFlow op names it again (see tests/mpi/test_errors.py).
    from mpi4py import MPI

    from perseus.runtime import collectives as _c

    def submit(name):
        return _c.allreduce_async(np.ones(2, np.float32), np.empty(2, np.float32), name=name)

    mine = f"tf_dup.{hvd.rank()}"
    handles = {mine: submit(mine)}
    with pytest.raises(ValueError, match="already in flight"):
        hvd.allreduce(tf.ones([2]), name=mine)
    MPI.COMM_WORLD.Barrier()
    for name in (f"tf_dup.{r}" for r in range(hvd.size())):
        if name not in handles:
            handles[name] = submit(name)
    for name in sorted(handles):
        _c.synchronize(handles[name])


# -- objects, join, barrier ----------------------------------------------------------------------------------
def test_objects_join_barrier():
    obj = {"rank": hvd.rank(), "payload": list(range(hvd.rank() + 1))}
    got = hvd.broadcast_object(obj, root_rank=hvd.size() - 1)
    assert got == {"rank": hvd.size() - 1, "payload": list(range(hvd.size()))}
    assert hvd.broadcast_object_fn(root_rank=0)("x" * (hvd.rank() + 1)) == "x"
    assert hvd.allgather_object(obj) == [{"rank": r, "payload": list(range(r + 1))} for r in ranks()]
    hvd.barrier()
    tf.function(lambda: hvd.barrier())()
    last = hvd.join()
    assert last.dtype == tf.int32 and 0 <= int(last) < hvd.size()


# -- DistributedGradientTape ---------------------------------------------------------------------------------
def _problem(batch_per_rank=4):
    rng = np.random.default_rng(1234)
    n = hvd.size()
    X = rng.standard_normal((n * batch_per_rank, 5)).astype(np.float32)
    Y = rng.standard_normal((n * batch_per_rank, 3)).astype(np.float32)
    W0 = rng.standard_normal((5, 3)).astype(np.float32)
    b0 = rng.standard_normal((3,)).astype(np.float32)
    return X, Y, W0, b0


def _loss(W, b, X, Y):
    return tf.reduce_mean(tf.square(tf.matmul(X, W) + b - Y))


def _train(X, Y, W0, b0, distributed, steps=5, lr=0.1, in_function=False):
    W, b = tf.Variable(W0), tf.Variable(b0)

    def step(X, Y):
        with tf.GradientTape() as tape:
            loss = _loss(W, b, X, Y)
        if distributed:
            tape = hvd.DistributedGradientTape(tape)
        gW, gb = tape.gradient(loss, [W, b])
        W.assign_sub(lr * gW)
        b.assign_sub(lr * gb)
    if in_function:
        step = tf.function(step)
    for _ in range(steps):
        step(tf.constant(X), tf.constant(Y))
    return W.numpy(), b.numpy()


@pytest.mark.parametrize("in_function", [False, True])
def test_distributed_gradient_tape_matches_global_batch(in_function):
    B = 4
    X, Y, W0, b0 = _problem(B)
    me = hvd.rank()
    Wd, bd = _train(X[me * B:(me + 1) * B], Y[me * B:(me + 1) * B], W0, b0, True, in_function=in_function)
    Wr, br = _train(X, Y, W0, b0, False)
    np.testing.assert_allclose(Wd, Wr, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bd, br, rtol=1e-5, atol=1e-6)
    gathered = hvd.allgather(tf.constant(np.concatenate([Wd.ravel(), bd])[None]))
    assert all(np.array_equal(gathered[0].numpy(), gathered[r].numpy()) for r in ranks())


def test_distributed_gradient_tape_sparse_none_and_local():
    emb = tf.Variable(tf.ones([6, 2]))
    unused = tf.Variable(tf.ones([2]))
    local = tf.Variable(tf.ones([2]))
    idx = tf.constant([hvd.rank() % 6, 5])
    results = {}
    for sparse_as_dense in (False, True):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(emb, idx) * float(hvd.rank() + 1)) + tf.reduce_sum(local)
        tape = hvd.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense)
        tape.register_local_source(local)
        g_emb, g_unused, g_local = tape.gradient(loss, [emb, unused, local])
        assert g_unused is None
        assert isinstance(g_emb, tf.IndexedSlices) != sparse_as_dense
        np.testing.assert_allclose(g_local.numpy(), np.full(2, 1.0 / hvd.size()))
        results[sparse_as_dense] = tf.convert_to_tensor(g_emb).numpy()
    ref = np.zeros((6, 2))
    for r in ranks():
        ref[r % 6] += (r + 1.0) / hvd.size()
        ref[5] += (r + 1.0) / hvd.size()
    np.testing.assert_allclose(results[False], ref, rtol=1e-6)
    np.testing.assert_allclose(results[True], ref, rtol=1e-6)


def test_distributed_gradient_tape_groups_and_predivide():
    vs = [tf.Variable(tf.ones([3]) * (i + 1)) for i in range(4)]
    for kwargs in ({"groups": 2}, {"groups": [[vs[0], vs[2]]]}, {"gradient_predivide_factor": 2.0},
                   {"op": hvd.Sum}):
        with tf.GradientTape() as tape:
            loss = sum(tf.reduce_sum(v * v) for v in vs) * float(hvd.rank() + 1)
        grads = hvd.DistributedGradientTape(tape, **kwargs).gradient(loss, vs)
        factor = np.mean([r + 1.0 for r in ranks()]) * (hvd.size() if kwargs.get("op") == hvd.Sum else 1)
        for i, g in enumerate(grads):
            np.testing.assert_allclose(g.numpy(), np.full(3, 2.0 * (i + 1) * factor), rtol=1e-6)


def test_tf1_session_runs_more_collectives_than_threads():
    """A TF1 graph whose one session.run holds many independent collectives, on a single inter-op thread: the
    asynchronous await op must keep the thread free for the enqueues the peers wait for (a blocking wait
    would stall here)."""
    import shutil

    from perseus.tensorflow import _await
    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the await op cannot be built here")
    assert _await.load() is not None
    r, n = hvd.rank(), hvd.size()
    graph = tf.Graph()
    with graph.as_default():
        outs = [hvd.allreduce(tf.fill([3 + i], float(r + i)), op=hvd.Sum) for i in range(12)]
        gathered = [hvd.allgather(tf.fill([1 + (r + i) % 2, 2], float(i))) for i in range(6)]
        config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1, intra_op_parallelism_threads=1)
        with tf.compat.v1.Session(graph=graph, config=config) as sess:
            for _ in range(2):
                values, gathers = sess.run([outs, gathered])
    for i, v in enumerate(values):
        np.testing.assert_allclose(v, np.full(3 + i, sum(k + i for k in range(n))))
    for i, g in enumerate(gathers):
        assert g.shape == (sum(1 + (k + i) % 2 for k in range(n)), 2)


def test_tf1_optimizer_averages_gradients_in_a_session():
    """A TF1 tf.compat.v1.train.Optimizer wrapped by DistributedOptimizer: minimize() in a session applies the
    gradients averaged over the ranks; the other options refuse clearly."""
    r, n = hvd.rank(), hvd.size()
    graph = tf.Graph()
    with graph.as_default():
        w = tf.compat.v1.get_variable("w", initializer=[1.0, 2.0], use_resource=True)
        x = tf.constant([float(r + 1), 2.0 * (r + 1)])
        loss = tf.reduce_sum(w * x)  # d loss / d w = x, different on every rank
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.5))
        assert isinstance(opt, tf.compat.v1.train.Optimizer)
        grads = opt.compute_gradients(loss)
        train = opt.minimize(loss)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            g = sess.run(grads[0][0])
            sess.run(train)
            after = sess.run(w)
    mean = sum(k + 1 for k in range(n)) / n
    np.testing.assert_allclose(g, [mean, 2 * mean], rtol=1e-6)
    np.testing.assert_allclose(after, [1.0 - 0.5 * mean, 2.0 - mean], rtol=1e-6)
    with pytest.raises(NotImplementedError, match="backward_passes_per_step"):
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.5), backward_passes_per_step=2)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.5), op=hvd.Adasum,
                                 gradient_predivide_factor=2.0)


def test_broadcast_global_variables_hook_in_a_monitored_session():
    """Horovod's TF1 hook: in a MonitoredTrainingSession every rank starts from rank 0's initial values, and a
    training step afterwards keeps them equal."""
    r, n = hvd.rank(), hvd.size()
    graph = tf.Graph()
    with graph.as_default():
        w = tf.compat.v1.get_variable("w", initializer=tf.constant([float(r + 1), -float(r)]), use_resource=True)
        step = tf.compat.v1.train.get_or_create_global_step()
        loss = tf.reduce_sum(w * w)
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
        train = opt.minimize(loss, global_step=step)
        hooks = [hvd.BroadcastGlobalVariablesHook(0)]
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as sess:
            start = sess.run(w)
            sess.run(train)
            after = sess.run(w)
    np.testing.assert_allclose(start, [1.0, 0.0])
    np.testing.assert_allclose(after, [0.8, 0.0], rtol=1e-6)
    gathered = hvd.allgather_object(after.tolist())
    assert all(g == gathered[0] for g in gathered) and n == len(gathered)
