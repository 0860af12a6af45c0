"""Every perseus.mxnet collective x dtype x form, against references built from all ranks' inputs."""

import mxnet as mx
import numpy as np
import pytest

from mx_reference import DTYPES, nd, rank_data, reduce_ref, wrap

OPS = ["Sum", "Average", "Min", "Max", "Product"]
SHAPES = [(), (17,), (3, 5, 2), (1 << 17,)]  # scalar, odd, 3-d, large (the engine reduces it in place)


def inputs_for(hvd, shape, dtype, seed=0, ranks=None):
    return [rank_data(r, shape, dtype, seed) for r in (ranks if ranks is not None else range(hvd.size()))]


def small(arrays, dtype):
    """Keep products exact: values in [-2, 2] ([0, 2] unsigned)."""
    return [np.clip(a, 0 if dtype.startswith("uint") else -2, 2).astype(dtype) for a in arrays]


def expected(inputs, op, dtype):
    return wrap(reduce_ref(inputs, op), dtype)


def check(out, want, dtype):
    assert isinstance(out, mx.nd.NDArray)
    got = out.asnumpy()
    assert got.dtype == np.dtype(dtype), (got.dtype, dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    tol = 1e-2 if dtype == "float16" else 1e-6
    if np.dtype(dtype).kind == "f":
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)
    else:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_allreduce(hvd, dtype, op):
    for i, shape in enumerate(SHAPES):
        if op == "Product" and len(shape) == 1 and shape[0] > 1000 and dtype != "float64":
            shape = (64,)
        inputs = inputs_for(hvd, shape, dtype, seed=i)
        if op == "Product":
            inputs = small(inputs, dtype)
        mine = nd(inputs[hvd.rank()])
        out = hvd.allreduce(mine, op=getattr(hvd, op), name=f"ar.{dtype}.{op}.{i}")
        np.testing.assert_array_equal(mine.asnumpy(), inputs[hvd.rank()])  # the input is untouched
        check(out, expected(inputs, op, dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_inplace_and_grouped_forms(hvd, dtype):
    rank = hvd.rank()
    shapes = [(4,), (2, 3), (1 << 16,)]
    inputs = [inputs_for(hvd, s, dtype, seed=10 + k) for k, s in enumerate(shapes)]
    want = [expected(x, "Sum", dtype) for x in inputs]
    # allreduce_: in place, returns the same NDArray
    t = nd(inputs[0][rank])
    assert hvd.allreduce_(t, op=hvd.Sum, name=f"ar_.{dtype}") is t
    check(t, want[0], dtype)
    # grouped_allreduce: new NDArrays, inputs untouched
    mine = [nd(x[rank]) for x in inputs]
    outs = hvd.grouped_allreduce(mine, op=hvd.Sum, name=f"gar.{dtype}")
    assert len(outs) == len(mine)
    for o, w, m, x in zip(outs, want, mine, inputs):
        check(o, w, dtype)
        np.testing.assert_array_equal(m.asnumpy(), x[rank])
    # grouped_allreduce_: in place
    mine = [nd(x[rank]) for x in inputs]
    assert hvd.grouped_allreduce_(mine, op=hvd.Sum, name=f"gar_.{dtype}") is mine
    for m, w in zip(mine, want):
        check(m, w, dtype)


def test_allreduce_average_default_and_deprecated_average(hvd):
    rank, size = hvd.rank(), hvd.size()
    inputs = inputs_for(hvd, (6,), "float32", seed=20)
    check(hvd.allreduce(nd(inputs[rank]), name="avg_default"), expected(inputs, "Average", "float32"), "float32")
    with pytest.warns(DeprecationWarning):
        out = hvd.allreduce(nd(inputs[rank]), average=False, name="avg_false")
    check(out, expected(inputs, "Sum", "float32"), "float32")
    with pytest.raises(ValueError, match="supersedes"):
        hvd.allreduce(nd(inputs[rank]), average=True, op=hvd.Sum)
    assert size >= 1


@pytest.mark.parametrize("dtype", ["int32", "int64", "float16", "float32", "float64"])
def test_allreduce_prescale_postscale(hvd, dtype):
    rank, size = hvd.rank(), hvd.size()
    inputs = inputs_for(hvd, (5, 7), dtype, seed=30)
    pre, post = 0.5, 3.0
    out = hvd.allreduce(nd(inputs[rank]), op=hvd.Sum, prescale_factor=pre, postscale_factor=post,
                        name=f"scaled.{dtype}")
    if np.dtype(dtype).kind in "iu":  # integers are scaled in float64 and truncated at each scaling
        pres = [np.trunc(a.astype(np.float64) * pre) for a in inputs]
        want = wrap(np.trunc(np.sum(pres, 0) * post), dtype)
    else:
        want = (np.sum([a.astype(np.float64) * pre for a in inputs], 0) * post).astype(dtype)
    check(out, want, dtype)
    # Average with factors: the postscale is divided by the set size
    out = hvd.allreduce(nd(inputs[rank]), op=hvd.Average, postscale_factor=2.0, name=f"scaled_avg.{dtype}")
    if np.dtype(dtype).kind == "f":
        want = (np.sum([a.astype(np.float64) for a in inputs], 0) * 2.0 / size).astype(dtype)
        check(out, want, dtype)


def test_allreduce_priority_and_unnamed(hvd):
    rank = hvd.rank()
    inputs = inputs_for(hvd, (9,), "float32", seed=40)
    for priority in (-5, 0, 7):
        out = hvd.allreduce(nd(inputs[rank]), op=hvd.Sum, priority=priority, name=f"prio.{priority}")
        check(out, expected(inputs, "Sum", "float32"), "float32")
    for _ in range(3):  # unnamed calls are numbered in call order, the same on every rank
        check(hvd.allreduce(nd(inputs[rank]), op=hvd.Max), expected(inputs, "Max", "float32"), "float32")


def test_allreduce_bool_and_views(hvd):
    rank = hvd.rank()
    inputs = inputs_for(hvd, (11,), "bool", seed=50)
    out = hvd.allreduce(mx.nd.array(inputs[rank], dtype="bool"), op=hvd.Max, name="bool_any")
    np.testing.assert_array_equal(out.asnumpy(), reduce_ref(inputs, "Max"))
    b = mx.nd.array(inputs[rank], dtype="bool")
    hvd.allreduce_(b, op=hvd.Min, name="bool_all_")
    np.testing.assert_array_equal(b.asnumpy(), reduce_ref(inputs, "Min"))
    with pytest.raises(ValueError, match="Average"):
        hvd.allreduce(mx.nd.array(inputs[rank], dtype="bool"), name="bool_avg")
    # An in-place reduction of a view writes into the parent NDArray's memory, and only there.
    parent = mx.nd.zeros((4, 3)) + rank
    view = parent[1:3]
    hvd.allreduce_(view, op=hvd.Sum, name="view")
    total = sum(range(hvd.size()))
    want = np.full((4, 3), rank, np.float32)
    want[1:3] = total
    np.testing.assert_array_equal(parent.asnumpy(), want)


def test_allreduce_after_lazy_computation(hvd):
    """The input is read after MXNet's pending writes to it; the output is ready when the call returns."""
    rank, size = hvd.rank(), hvd.size()
    a = mx.nd.ones((256, 256)) * (rank + 1)
    b = mx.nd.dot(a, a)  # queued on MXNet's engine
    out = hvd.allreduce(b, op=hvd.Sum, name="lazy")
    want = sum(256.0 * (r + 1) ** 2 for r in range(size))
    np.testing.assert_allclose(out.asnumpy(), np.full((256, 256), want), rtol=1e-6)
    hvd.allreduce_(b, op=hvd.Sum, name="lazy_")
    np.testing.assert_allclose((b * 1).asnumpy(), np.full((256, 256), want), rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES + ["bool"])
def test_allgather(hvd, dtype):
    rank, size = hvd.rank(), hvd.size()
    for i, trailing in enumerate([(), (3,), (2, 4)]):
        inputs = [rank_data(r, (r + 1,) + trailing, dtype, seed=60 + i) for r in range(size)]
        mine = mx.nd.array(inputs[rank], dtype=dtype)
        out = hvd.allgather(mine, name=f"ag.{dtype}.{i}")
        assert out.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(out.asnumpy(), np.concatenate(inputs))
    # grouped: several tensors, each concatenated
    group = [[rank_data(r, (2 * r + 1, 3), dtype, seed=70 + k) for r in range(size)] for k in range(3)]
    outs = hvd.grouped_allgather([mx.nd.array(g[rank], dtype=dtype) for g in group], name=f"gag.{dtype}")
    for o, g in zip(outs, group):
        np.testing.assert_array_equal(o.asnumpy(), np.concatenate(g))


def test_allgather_scalar_and_priority(hvd):
    rank, size = hvd.rank(), hvd.size()
    out = hvd.allgather(mx.nd.array(float(rank)), name="ag_scalar", priority=3)
    np.testing.assert_array_equal(out.asnumpy(), np.arange(size, dtype=np.float32))


@pytest.mark.parametrize("dtype", DTYPES + ["bool"])
def test_broadcast(hvd, dtype):
    rank, size = hvd.rank(), hvd.size()
    for root in range(size):
        inputs = inputs_for(hvd, (3, 4), dtype, seed=80 + root)
        mine = mx.nd.array(inputs[rank], dtype=dtype)
        out = hvd.broadcast(mine, root, name=f"bc.{dtype}.{root}")
        np.testing.assert_array_equal(out.asnumpy(), inputs[root])
        np.testing.assert_array_equal(mine.asnumpy(), inputs[rank])  # the input is untouched
        assert hvd.broadcast_(mine, root_rank=root, name=f"bc_.{dtype}.{root}", priority=1) is mine
        np.testing.assert_array_equal(mine.asnumpy(), inputs[root])


@pytest.mark.parametrize("dtype", DTYPES)
def test_alltoall(hvd, dtype):
    rank, size = hvd.rank(), hvd.size()
    # rank r sends (r + k + 1) rows to rank k
    splits = {r: [r + k + 1 for k in range(size)] for r in range(size)}
    inputs = {r: rank_data(r, (sum(splits[r]), 3), dtype, seed=90) for r in range(size)}
    out, received = hvd.alltoall(mx.nd.array(inputs[rank], dtype=dtype),
                                 mx.nd.array(splits[rank], dtype="int32"), name=f"a2a.{dtype}")
    pieces = []
    for r in range(size):
        start = sum(splits[r][:rank])
        pieces.append(inputs[r][start:start + splits[r][rank]])
    np.testing.assert_array_equal(out.asnumpy(), np.concatenate(pieces))
    assert received.dtype == np.int32
    assert received.asnumpy().tolist() == [splits[r][rank] for r in range(size)]
    # splits as a list, and the even split without splits (only the output is returned)
    out2, _ = hvd.alltoall(mx.nd.array(inputs[rank], dtype=dtype), splits[rank], name=f"a2a_list.{dtype}")
    np.testing.assert_array_equal(out2.asnumpy(), out.asnumpy())
    even = {r: rank_data(r, (2 * size, 2), dtype, seed=91) for r in range(size)}
    out3 = hvd.alltoall(mx.nd.array(even[rank], dtype=dtype), name=f"a2a_even.{dtype}", priority=2)
    assert isinstance(out3, mx.nd.NDArray)
    np.testing.assert_array_equal(out3.asnumpy(), np.concatenate([even[r][2 * rank:2 * rank + 2]
                                                                  for r in range(size)]))


def test_alltoall_receives_nothing(hvd):
    rank, size = hvd.rank(), hvd.size()
    if size == 1:
        pytest.skip("needs 2+ ranks")
    # every rank sends all its rows to rank 0
    splits = [3] + [0] * (size - 1)
    out, received = hvd.alltoall(mx.nd.ones((3, 2)) * rank, splits, name="a2a_to_zero")
    if rank == 0:
        assert out.shape == (3 * size, 2)
        np.testing.assert_array_equal(out.asnumpy()[:, 0], np.repeat(np.arange(size), 3))
    else:
        assert out.shape == (0, 2)
    assert received.asnumpy().tolist() == ([3] * size if rank == 0 else [0] * size)


def _scatter_rows(n, size):
    base, extra = divmod(n, size)
    counts = [base + (1 if r < extra else 0) for r in range(size)]
    starts = np.cumsum([0] + counts)
    return counts, starts


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["Sum", "Average", "Min", "Max"])
def test_reducescatter(hvd, dtype, op):
    rank, size = hvd.rank(), hvd.size()
    for i, shape in enumerate([(4 * size, 3), (2 * size + 1,), (size + 2, 2, 2)]):
        inputs = inputs_for(hvd, shape, dtype, seed=100 + i)
        out = hvd.reducescatter(nd(inputs[rank]), op=getattr(hvd, op), name=f"rs.{dtype}.{op}.{i}")
        counts, starts = _scatter_rows(shape[0], size)
        want = expected(inputs, op, dtype)[starts[rank]:starts[rank] + counts[rank]]
        check(out, want, dtype)


def test_reducescatter_positional_op_scale_and_grouped(hvd):
    rank, size = hvd.rank(), hvd.size()
    inputs = [inputs_for(hvd, (2 * size, 3), "float32", seed=110 + k) for k in range(3)]
    # op is the second positional argument, as in Horovod's horovod.mxnet
    out = hvd.reducescatter(nd(inputs[0][rank]), hvd.Sum, "rs_pos", 0, hvd.global_process_set, 2.0, 0.5)
    check(out, expected(inputs[0], "Sum", "float32")[2 * rank:2 * rank + 2], "float32")
    outs = hvd.grouped_reducescatter([nd(x[rank]) for x in inputs], op=hvd.Average, name="grs", priority=1)
    for o, x in zip(outs, inputs):
        check(o, expected(x, "Average", "float32")[2 * rank:2 * rank + 2], "float32")


def test_process_sets(hvd):
    rank, size = hvd.rank(), hvd.size()
    if size == 1:
        pytest.skip("needs 2+ ranks")
    even = hvd.add_process_set([r for r in range(size) if r % 2 == 0])
    odd = hvd.add_process_set([r for r in range(size) if r % 2 == 1])
    try:
        mine = even if rank % 2 == 0 else odd
        members = mine.ranks
        inputs = inputs_for(hvd, (5,), "float32", seed=120, ranks=members)
        idx = members.index(rank)
        out = hvd.allreduce(nd(inputs[idx]), op=hvd.Sum, name="ps_ar", process_set=mine)
        check(out, expected(inputs, "Sum", "float32"), "float32")
        outs = hvd.grouped_allreduce([nd(inputs[idx])] * 2, op=hvd.Max, name="ps_gar", process_set=mine)
        for o in outs:
            check(o, expected(inputs, "Max", "float32"), "float32")
        g = hvd.allgather(mx.nd.ones((1, 2)) * rank, name="ps_ag", process_set=mine)
        np.testing.assert_array_equal(g.asnumpy()[:, 0], np.array(members, np.float32))
        b = hvd.broadcast(mx.nd.ones((3,)) * rank, members[-1], name="ps_bc", process_set=mine)
        np.testing.assert_array_equal(b.asnumpy(), np.full(3, members[-1], np.float32))
        a = hvd.alltoall(mx.nd.ones((len(members), 1)) * rank, name="ps_a2a", process_set=mine)
        np.testing.assert_array_equal(a.asnumpy()[:, 0], np.array(members, np.float32))
        rs = hvd.reducescatter(mx.nd.ones((2 * len(members), 2)), op=hvd.Sum, name="ps_rs", process_set=mine)
        np.testing.assert_array_equal(rs.asnumpy(), np.full((2, 2), len(members), np.float32))
        assert hvd.broadcast_object({"r": rank}, members[0], process_set=mine) == {"r": members[0]}
        assert hvd.allgather_object(rank, process_set=mine) == members
        # A rank outside a set is refused before anything is sent.
        other = odd if mine is even else even
        with pytest.raises(ValueError, match="not a member"):
            hvd.allreduce(mx.nd.ones((2,)), name="ps_foreign", process_set=other)
    finally:
        hvd.remove_process_set(odd)
        hvd.remove_process_set(even)


def test_objects(hvd):
    rank, size = hvd.rank(), hvd.size()
    obj = {"hello": 123, "rank": rank, "blob": list(range(rank * 100))}
    got = hvd.broadcast_object(obj, root_rank=size - 1)
    assert got == {"hello": 123, "rank": size - 1, "blob": list(range((size - 1) * 100))}
    gathered = hvd.allgather_object({"r": rank, "pad": "x" * rank})
    assert gathered == [{"r": r, "pad": "x" * r} for r in range(size)]


def test_basics(hvd):
    assert hvd.is_initialized()
    assert 0 <= hvd.rank() < hvd.size()
    assert 0 <= hvd.local_rank() < hvd.local_size()
    assert 0 <= hvd.cross_rank() < hvd.cross_size()
    assert hvd.mpi_threads_supported() and hvd.mpi_enabled() and hvd.mpi_built()
    assert not hvd.gloo_built() and not hvd.cuda_built() and hvd.nccl_built() == 0
    assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == (0, 1, 2, 3, 4, 5)
    assert hvd.global_process_set.process_set_id == 0
    assert hvd.mpi_ops._basics._get_process_set_ids_and_ranks()[0] == list(range(hvd.size()))
    hvd.init()  # a second init is a no-op
    assert hvd.is_initialized()
    assert not hvd._check_has_gpu()


@pytest.mark.parametrize("dtype", ["int32", "float32"])
def test_copy_path_without_dlpack(hvd, dtype, monkeypatch):
    """The copying bridge (used for bool, and for every dtype when NumPy cannot import DLPack)."""
    from perseus.mxnet import _bridge

    monkeypatch.setattr(_bridge, "_DLPACK", set())
    rank, size = hvd.rank(), hvd.size()
    inputs = inputs_for(hvd, (2 * size, 3), dtype, seed=130)
    check(hvd.allreduce(nd(inputs[rank]), op=hvd.Sum, name=f"cp_ar.{dtype}"), expected(inputs, "Sum", dtype), dtype)
    t = nd(inputs[rank])
    hvd.allreduce_(t, op=hvd.Max, name=f"cp_ar_.{dtype}")
    check(t, expected(inputs, "Max", dtype), dtype)
    t = nd(inputs[rank])
    hvd.broadcast_(t, 0, name=f"cp_bc_.{dtype}")
    check(t, inputs[0], dtype)
    out = hvd.reducescatter(nd(inputs[rank]), op=hvd.Sum, name=f"cp_rs.{dtype}")
    check(out, expected(inputs, "Sum", dtype)[2 * rank:2 * rank + 2], dtype)
    np.testing.assert_array_equal(hvd.allgather(nd(inputs[rank]), name=f"cp_ag.{dtype}").asnumpy(),
                                  np.concatenate(inputs))


def test_allreduce_adasum(hvd):
    """Adasum of two ranks' vectors (rank 0's as a): the formula, applied pairwise up the tree."""
    rng = np.random.default_rng(3)
    vs = [rng.normal(size=9) for _ in range(hvd.size())]

    def pair(a, b):
        ab, aa, bb = a @ b, a @ a, b @ b
        return (1 - ab / (2 * aa)) * a + (1 - ab / (2 * bb)) * b

    def tree(x):
        return x[0] if len(x) == 1 else pair(tree(x[:len(x) // 2]), tree(x[len(x) // 2:]))

    p2 = 1
    while p2 * 2 <= hvd.size():
        p2 *= 2
    folded = list(vs[:p2])
    for i in range(hvd.size() - p2):
        folded[i] = pair(folded[i], vs[p2 + i])
    out = hvd.allreduce(mx.nd.array(vs[hvd.rank()], dtype="float64"), op=hvd.Adasum, name="adasum")
    np.testing.assert_allclose(out.asnumpy(), tree(folded), rtol=1e-12, atol=1e-12)
