"""Sparse all-reduce under mpirun (2, 3 and 4 ranks): every algorithm equals the dense sum bit for bit on
integer values, whatever the density, overlap and skew; results are identical on every rank; ranks that
disagree about a tensor all raise; Zen training equals dense data-parallel training.

Every rank can rebuild every other rank's input (seeded by rank), so references are computed locally.
"""

import os

import numpy as np
import pytest
import torch

import perseus.torch as hvd
from perseus import sparse
from perseus.runtime.state import runtime
from perseus.base.exceptions import HorovodInternalError

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

pytestmark = [pytest.mark.timeout(240), pytest.mark.rank_count]

ALGS = ["zen", "allgather", "dense", "alltoall", "auto"]
R, D = 4000, 3


def _rows(rank, case, R=R):
    """Row ids (with duplicates) of ``rank`` for ``case``."""
    n = hvd.size()
    rng = np.random.default_rng(1000 + rank + 17 * len(case))
    density = {"d0.1%": 0.001, "d1%": 0.01, "d10%": 0.1, "d60%": 0.6}
    if case in density:
        rows = rng.integers(0, R, max(1, int(density[case] * R) * (1 + rank % 2)))  # uneven counts
    elif case == "disjoint":  # no overlap: each rank its own range
        lo = rank * (R // n)
        rows = rng.integers(lo, lo + R // n, 50 + 10 * rank)
    elif case == "full_overlap":
        rows = np.random.default_rng(5).integers(0, R, 300)
    elif case == "zipf":
        rows = (rng.zipf(1.3, 3000) - 1) % R
    elif case == "one_empty":
        rows = np.zeros(0, np.int64) if rank == 1 else rng.integers(0, R, 40)
    elif case == "all_empty":
        rows = np.zeros(0, np.int64)
    elif case == "edges":  # the first and last rows, and one row everybody has
        rows = np.array([0, R - 1, 7, 0])
    else:
        raise ValueError(case)
    return rows.astype(np.int64)


def _tensor(rank, case, dtype=torch.float32, width=D, R=R):
    rows = _rows(rank, case, R)
    vals = np.random.default_rng(rank).integers(-8, 8, (rows.size, width)).astype(np.float32)
    return torch.sparse_coo_tensor(torch.from_numpy(rows).reshape(1, -1), torch.from_numpy(vals).to(dtype),
                                   (R, width))


def _ref(case, op=hvd.Sum, **kw):
    total = sum(_tensor(r, case, **kw).to_dense() for r in range(hvd.size()))
    return total / hvd.size() if op == hvd.Average else total


def _same_everywhere(t, what):
    flat = t.reshape(1, -1).to(torch.float64)
    got = hvd.allgather(flat, name=f"same.{what}")
    assert all(torch.equal(got[0], got[r]) for r in range(hvd.size())), f"{what} differs between ranks"


def _healthy():
    out = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="sparse_after_error")
    assert out.tolist() == [hvd.size()] * 2


# -- sums --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["d0.1%", "d1%", "d10%", "d60%", "disjoint", "full_overlap", "zipf", "one_empty",
                                  "all_empty", "edges"])
@pytest.mark.parametrize("alg", ALGS)
def test_sum_equals_dense_sum(alg, case):
    name = f"sum.{alg}.{case}"
    out = hvd.sparse_allreduce_async(_tensor(hvd.rank(), case), name, hvd.Sum, algorithm=alg)()
    assert out.is_sparse and out.shape == (R, D) and out.dtype == torch.float32
    dense = out.to_dense()
    assert torch.equal(dense, _ref(case)), f"{alg} {case}"
    if out._nnz() and alg != "allgather":
        assert out.is_coalesced()
        present = np.unique(np.concatenate([_rows(r, case) for r in range(hvd.size())]))
        assert out.indices()[0].numpy().tolist() == present.tolist()  # the rows some rank had
    _same_everywhere(dense, name)
    st = sparse.stats(name)
    assert st is not None and st.ranks == hvd.size()
    if alg != "auto":
        assert st.algorithm == alg


@pytest.mark.parametrize("alg", ALGS)
def test_average(alg):
    out = hvd.sparse_allreduce_async(_tensor(hvd.rank(), "d10%"), f"avg.{alg}", hvd.Average, algorithm=alg)()
    torch.testing.assert_close(out.to_dense(), _ref("d10%", hvd.Average), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_dtypes(dtype):
    out = hvd.sparse_allreduce_async(_tensor(hvd.rank(), "d1%", dtype), f"dtype.{dtype}", hvd.Sum,
                                     algorithm="zen")()
    assert out.dtype == dtype
    assert torch.equal(out.to_dense().float(), _ref("d1%", dtype=dtype).float())


def test_two_sparse_dims_and_row_shapes():
    # an element-sparse matrix (sparse_dim 2) and rows of shape (2, 3)
    out = hvd.sparse_allreduce_async(_draw(hvd.rank()).to_sparse(), "twodims", hvd.Sum, algorithm="zen")()
    assert out.sparse_dim() == 2
    assert torch.equal(out.to_dense(), sum(_draw(r) for r in range(hvd.size())))
    rows = torch.tensor([[hvd.rank(), 5]])
    vals = torch.ones(2, 2, 3) * (hvd.rank() + 1)
    out = hvd.sparse_allreduce_async(torch.sparse_coo_tensor(rows, vals, (9, 2, 3)), "rowshape", hvd.Sum,
                                     algorithm="alltoall")()
    want = torch.zeros(9, 2, 3)
    for r in range(hvd.size()):
        want[r] += r + 1
        want[5] += r + 1
    assert torch.equal(out.to_dense(), want)


def _draw(r):
    rng = np.random.default_rng(r)
    return torch.from_numpy(rng.integers(-3, 3, (30, 20)) * (rng.random((30, 20)) < 0.1)).float()


def test_hash_partitioner_with_overflow():
    cfg = runtime().settings
    saved = (cfg.zen_partitioner, cfg.zen_hash_funcs, cfg.zen_load_factor, cfg.zen_serial_fraction)
    try:
        cfg.zen_partitioner, cfg.zen_hash_funcs, cfg.zen_load_factor, cfg.zen_serial_fraction = "check", 1, 8.0, 0.0
        out = hvd.sparse_allreduce_async(_tensor(hvd.rank(), "d10%"), "overflow", hvd.Sum, algorithm="zen")()
        assert torch.equal(out.to_dense(), _ref("d10%"))
        st = sparse.stats("overflow")
        assert st.overflowed and st.serial_fraction > 0.5
        cfg.zen_partitioner, cfg.zen_hash_funcs, cfg.zen_load_factor, cfg.zen_serial_fraction = "hash", 3, 0.5, 0.1
        out = hvd.sparse_allreduce_async(_tensor(hvd.rank(), "zipf"), "hashpart", hvd.Sum, algorithm="zen")()
        assert torch.equal(out.to_dense(), _ref("zipf"))
    finally:
        cfg.zen_partitioner, cfg.zen_hash_funcs, cfg.zen_load_factor, cfg.zen_serial_fraction = saved


def test_zen_balance_and_bytes():
    big = 1 << 20
    rng = np.random.default_rng(hvd.rank())
    rows = np.unique(rng.integers(0, big, 30000))
    t = torch.sparse_coo_tensor(torch.from_numpy(rows)[None], torch.ones(rows.size, 1), (big, 1))
    out = hvd.sparse_allreduce_async(t, "balance", hvd.Sum, algorithm="zen")()
    st = sparse.stats("balance")
    assert st.push_imbalance <= 1.1 and st.pull_imbalance <= 1.1, st
    assert st.nnz[hvd.rank()] == rows.size and st.union == out._nnz()
    assert st.index_bytes <= big // 8 + hvd.size()
    gathered = hvd.sparse_allreduce_async(t, "balance_ag", hvd.Sum, algorithm="allgather")()
    assert torch.equal(gathered.to_dense(), out.to_dense())
    # overlapping rows of 16 floats: every rank receives every other rank's rows with allgather, about 1/n
    # of them plus the summed rows with Zen
    rows = np.unique(rng.integers(0, 25000, 30000))
    t = torch.sparse_coo_tensor(torch.from_numpy(rows)[None], torch.ones(rows.size, 16), (big, 16))
    z = hvd.sparse_allreduce_async(t, "overlap_zen", hvd.Sum, algorithm="zen")()
    g = hvd.sparse_allreduce_async(t, "overlap_ag", hvd.Sum, algorithm="allgather")()
    assert torch.equal(z.to_dense(), g.to_dense())
    if hvd.size() >= 3:
        assert sparse.stats("overlap_ag").received_bytes > 1.15 * sparse.stats("overlap_zen").received_bytes


def test_auto_is_consistent_across_ranks():
    walk = ["d1%", "d60%", "d60%", "d0.1%", "d0.1%", "full_overlap"] + ["d10%"] * 12
    how = []
    for step, case in enumerate(walk):
        out = hvd.sparse_allreduce_async(_tensor(hvd.rank(), case), "auto.walk", hvd.Sum, algorithm="auto")()
        assert torch.equal(out.to_dense(), _ref(case)), (step, case)
        st = sparse.stats("auto.walk")
        how.append(st.decided_by)
        # the choice, and the measurements it is made from, are the same on every rank
        facts = [sparse.ALGORITHMS.index(st.algorithm)] + [st.corrections.get(a, -1.0) for a in sparse.ALGORITHMS]
        got = hvd.allgather(torch.tensor([facts], dtype=torch.float64), name=f"auto.walk.{step}")
        assert all(torch.equal(got[0], got[r]) for r in range(hvd.size())), f"step {step}: ranks differ: {got}"
        if step:
            assert st.decided_by in ("auto", "explore") and set(st.predicted) >= {"zen", "allgather"}
    assert how[0] == "first call" and how[-1] == "auto", how
    assert sparse.stats("auto.walk").corrections  # measured times came back


def test_policy_forces_auto():
    try:
        sparse.set_policy("alltoall")
        hvd.sparse_allreduce_async(_tensor(hvd.rank(), "d1%"), "forced", hvd.Sum, algorithm="auto")()
        assert sparse.stats("forced").algorithm == "alltoall"
        assert sparse.stats("forced").decided_by == "policy"
    finally:
        sparse.set_policy(None)


# -- disagreements ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("alg", ALGS)
def test_different_table_sizes_raise_everywhere(alg):
    if hvd.size() == 1:
        pytest.skip("needs 2+ ranks")
    rows = 100 if hvd.rank() == 0 else 101
    t = torch.sparse_coo_tensor(torch.tensor([[3, 7]]), torch.ones(2, 2), (rows, 2))
    with pytest.raises(HorovodInternalError, match=f"mismatch_{alg}"):
        hvd.sparse_allreduce_async(t, f"mismatch_{alg}", hvd.Sum, algorithm=alg)()
    _healthy()


def test_different_algorithms_raise_everywhere():
    if hvd.size() == 1:
        pytest.skip("needs 2+ ranks")
    alg = "zen" if hvd.rank() == 0 else "allgather"
    with pytest.raises(HorovodInternalError, match="mismatch_alg"):
        hvd.sparse_allreduce_async(_tensor(hvd.rank(), "d1%"), "mismatch_alg", hvd.Sum, algorithm=alg)()
    _healthy()


def test_bad_arguments():
    with pytest.raises(ValueError, match="algorithm"):
        hvd.sparse_allreduce_async(_tensor(0, "d1%"), "bad", hvd.Sum, algorithm="fastest")
    with pytest.raises(ValueError, match="Sum and Average"):
        hvd.sparse_allreduce_async(_tensor(0, "d1%"), "bad", hvd.Max)
    with pytest.raises(ValueError, match="sparse"):
        hvd.sparse_allreduce_async(torch.ones(3), "bad", hvd.Sum)
    with pytest.raises(ValueError, match="unknown sparse algorithm"):
        hvd.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1),
                                 sparse_algorithm="fastest")


# -- training ------------------------------------------------------------------------------------------------------
class _Model(torch.nn.Module):
    def __init__(self, sparse_grad):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, 6, sparse=sparse_grad)
        self.bag = torch.nn.EmbeddingBag(40, 6, mode="sum", sparse=sparse_grad)
        self.head = torch.nn.Linear(12, 1)

    def forward(self, tokens, bag_ids, offsets):
        return self.head(torch.cat([self.emb(tokens), self.bag(bag_ids, offsets)], dim=1)).squeeze(1)


def _batch(rank, step):
    """Rank ``rank``'s batch at ``step``: 2 + rank samples (uneven token counts), bags of 1-4 ids."""
    rng = np.random.default_rng(100 * step + rank)
    m = 2 + rank
    tokens = torch.from_numpy(rng.zipf(1.5, m) % 50)
    lengths = rng.integers(1, 5, m)
    bag_ids = torch.from_numpy(rng.integers(0, 40, int(lengths.sum())))
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)[:-1]]))
    y = torch.from_numpy(rng.standard_normal(m).astype(np.float32))
    return tokens, bag_ids, offsets, y


def _loss(model, batch):
    tokens, bag_ids, offsets, y = batch
    return ((model(tokens, bag_ids, offsets) - y) ** 2).mean()


def _optimizers(model, kind):
    if kind == "sgd":
        return [torch.optim.SGD(model.parameters(), lr=0.1)]
    sparse_params = list(model.emb.parameters()) + list(model.bag.parameters())
    if model.emb.sparse:
        return [torch.optim.SparseAdam(sparse_params, lr=0.01), torch.optim.Adam(model.head.parameters(), lr=0.01)]
    return [torch.optim.Adam(sparse_params, lr=0.01), torch.optim.Adam(model.head.parameters(), lr=0.01)]


def _train_distributed(kind, sparse_grad, algorithm, steps=5):
    model = _Model(sparse_grad)
    named = dict(model.named_parameters())
    opts = []
    for opt in _optimizers(model, kind):
        ids = {id(p) for g in opt.param_groups for p in g["params"]}
        opts.append(hvd.DistributedOptimizer(opt, named_parameters=[(k, p) for k, p in named.items() if id(p) in ids],
                                             sparse_algorithm=algorithm))
    for step in range(steps):
        for o in opts:
            o.zero_grad()
        _loss(model, _batch(hvd.rank(), step)).backward()
        for o in opts:
            o.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train_reference(kind, sparse_grad, steps=5):
    """One process, no communication: the loss is the mean of every rank's loss (what data-parallel
    training with averaged gradients minimises)."""
    model = _Model(sparse_grad)
    opts = _optimizers(model, kind)
    for step in range(steps):
        for o in opts:
            o.zero_grad()
        loss = sum(_loss(model, _batch(r, step)) for r in range(hvd.size())) / hvd.size()
        loss.backward()
        for o in opts:
            o.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("alg", ALGS)
def test_sgd_training_equals_dense_data_parallel(alg):
    got = _train_distributed("sgd", True, alg)
    ref = _train_reference("sgd", False)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    if alg == "zen":
        dense_dp = _train_distributed("sgd", False, None)  # plain allreduce of dense gradients
        torch.testing.assert_close(got, dense_dp, rtol=1e-5, atol=1e-6)
        _same_everywhere(got, "sgd.zen")
    assert sparse.stats("grad.emb.weight") is not None


def test_adam_training_zen_equals_allgather_and_reference():
    # SparseAdam only updates the rows present in a step's gradient, dense Adam every row: they are different
    # optimizers, so Zen + SparseAdam is compared with allgather + SparseAdam and with one process running
    # SparseAdam on the mean loss of every rank's batch (whose gradient has the same rows: those any rank had).
    zen_params = _train_distributed("adam", True, "zen")
    ag_params = _train_distributed("adam", True, "allgather")
    ref = _train_reference("adam", True)
    torch.testing.assert_close(zen_params, ag_params, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(zen_params, ref, rtol=1e-5, atol=1e-6)
    _same_everywhere(zen_params, "adam.zen")


# -- TensorFlow ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("alg", ["zen", "auto", "allgather"])
def test_tf_indexed_slices(mode, alg):
    tf = pytest.importorskip("tensorflow")
    import perseus.tensorflow as htf

    def slices(r):
        rows = _rows(r, "d1%", 300)
        vals = np.random.default_rng(r).integers(-8, 8, (rows.size, 4)).astype(np.float32)
        return tf.IndexedSlices(tf.constant(vals), tf.constant(rows.astype(np.int32)), tf.constant([300, 4]))

    def fn(v, i, d):
        out = htf.allreduce(tf.IndexedSlices(v, i, d), op=htf.Sum, sparse_algorithm=alg, name=f"tf.{alg}")
        assert isinstance(out, tf.IndexedSlices)
        return tf.convert_to_tensor(out), out.indices
    s = slices(hvd.rank())
    call = fn if mode == "eager" else tf.function(fn)
    for _ in range(2):
        dense, indices = call(s.values, s.indices, s.dense_shape)
        ref = sum(tf.convert_to_tensor(slices(r)).numpy() for r in range(hvd.size()))
        assert np.array_equal(dense.numpy(), ref)
        assert indices.dtype == tf.int32
    _same_everywhere(torch.from_numpy(dense.numpy()), f"tf.{mode}.{alg}")
    # without a dense shape only allgather applies; Average divides
    out = htf.allreduce(tf.IndexedSlices(s.values, s.indices), op=htf.Average, name=f"tf.noshape.{mode}.{alg}")
    got = tf.math.unsorted_segment_sum(out.values, out.indices, 300).numpy()
    np.testing.assert_allclose(got, ref / hvd.size(), rtol=1e-6)
