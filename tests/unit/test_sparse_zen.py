"""Unit tests for perseus.sparse without MPI: hashes, partitions, the hash bitmap, imbalance, the message
formats of every algorithm (ranks simulated in one process), and the cost model's choices."""

from __future__ import annotations

import numpy as np
import pytest

from perseus.base.exceptions import MismatchError
from perseus.base.knobs import knob
from perseus.sparse import _format, allgather, choice, zen
from perseus.sparse.hashing import Seeds, h0_checksum, mix64, mix64_scalar, owner_of, reduce_range, slot_of

pytestmark = pytest.mark.timeout(120)


# -- hashing ----------------------------------------------------------------------------------------------------
def test_mixer_known_vectors():
    # mix64(x, s) is the (s+1)-th output of splitmix64 started at state x: published splitmix64 outputs
    assert mix64_scalar(0, 0) == 0xE220A8397B1DCDAF
    assert mix64_scalar(1234567, 0) == 6457827717110365317
    assert mix64_scalar(1234567, 1) == 3203168211198807973


def test_mixer_vectorised_matches_scalar():
    rng = np.random.default_rng(1)
    xs = np.concatenate([np.arange(100), rng.integers(0, 1 << 62, 200), [(1 << 63) - 1, 1 << 31, (1 << 31) - 1]])
    for seed in (0, 1, 42, (1 << 63) - 1, 0xDEADBEEFCAFEF00D):
        got = mix64(xs.astype(np.int64), seed)
        assert got.dtype == np.uint64
        assert [int(v) for v in got] == [mix64_scalar(int(x), seed) for x in xs]


def test_owner_and_slot_ranges():
    rows = np.arange(100000, dtype=np.int64)
    for n in (1, 2, 3, 4, 7, 16, 1000):
        o = owner_of(rows, n, 7)
        assert o.dtype == np.int64 and o.min() >= 0 and o.max() < n
        assert np.array_equal(o, owner_of(rows, n, 7))  # deterministic
        if n > 1:
            assert np.bincount(o, minlength=n).min() > 0
    s = slot_of(rows, 37, 9)
    assert s.min() >= 0 and s.max() < 37
    with pytest.raises(ValueError):
        reduce_range(mix64(rows[:3], 0), 0)
    # different seeds give different partitions
    assert not np.array_equal(owner_of(rows, 4, 1), owner_of(rows, 4, 2))


def test_seeds_derivation_and_checksum():
    s = Seeds(42, k=4)
    assert s.h0 == mix64_scalar(0, 42)
    assert list(s.slots) == [mix64_scalar(i, 42) for i in range(1, 5)]
    assert len(set([s.h0, *s.slots])) == 5
    assert h0_checksum(4, s.h0) == h0_checksum(4, Seeds(42).h0)
    assert h0_checksum(4, s.h0) != h0_checksum(4, Seeds(43).h0)
    assert h0_checksum(4, s.h0) != h0_checksum(3, s.h0)


# -- partitions -------------------------------------------------------------------------------------------------
def _sets(perm, counts):
    out, off = [], 0
    for c in counts.tolist():
        out.append(sorted(perm[off:off + c].tolist()))
        off += c
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 16])
@pytest.mark.parametrize("m", [0, 1, 10, 5000])
def test_hash_partition_equals_bucket_partition(n, m):
    seeds = Seeds(123, k=4)
    rows = np.unique(np.random.default_rng(m + n).integers(0, 10 ** 7, m))
    perm, counts = zen.bucket_partition(rows, n, seeds.h0)
    assert sorted(perm.tolist()) == list(range(rows.size))
    owners = owner_of(rows, n, seeds.h0)
    for j, part in enumerate(_sets(perm, counts)):
        assert all(owners[p] == j for p in part)
    for k in (1, 3, 4):
        hp, hc, info = zen.hash_partition(rows, n, seeds, k=k)
        assert sorted(hp.tolist()) == list(range(rows.size)), "a row was lost or duplicated"
        assert np.array_equal(hc, counts)
        assert _sets(hp, hc) == _sets(perm, counts)
        assert info["serial"] <= rows.size
    zen.partition(rows, n, seeds, "check")  # raises if they differ


def test_hash_partition_serial_region_and_overflow():
    seeds = Seeds(5)
    rows = np.unique(np.random.default_rng(0).integers(0, 1 << 40, 100000))
    perm, counts, info = zen.hash_partition(rows, 4, seeds, k=3, load_factor=0.5, serial_fraction=0.1)
    assert 0 < info["serial_fraction"] < 0.08 and not info["overflowed"]  # ~4% go serial at load factor 0.5
    # one slot hash, one slot per 8 rows, no serial region: most rows overflow, none is dropped
    perm, counts, info = zen.hash_partition(rows, 4, seeds, k=1, load_factor=8.0, serial_fraction=0.0)
    assert info["overflowed"] and info["serial"] > rows.size // 2
    ref, ref_counts = zen.bucket_partition(rows, 4, seeds.h0)
    assert np.array_equal(counts, ref_counts)
    assert _sets(perm, counts) == _sets(ref, ref_counts)
    # every row collides in one slot
    same = np.arange(64, dtype=np.int64)
    p, c, info = zen.hash_partition(same, 1, seeds, k=2, load_factor=64.0, serial_fraction=0.0)
    assert sorted(p.tolist()) == list(range(64)) and info["overflowed"]
    with pytest.raises(ValueError):
        zen.partition(same, 2, seeds, "nonsense")


def test_coalesce_sums_duplicates_in_order():
    rows = np.array([5, 1, 5, 3, 1, 5])
    vals = np.arange(12, dtype=np.float32).reshape(6, 2)
    r, v = zen.coalesce(rows, vals)
    assert r.tolist() == [1, 3, 5]
    assert v.tolist() == [[2 + 8, 3 + 9], [6, 7], [0 + 4 + 10, 1 + 5 + 11]]
    r, v = zen.coalesce(np.array([0, 2, 9]), vals[:3])
    assert r.tolist() == [0, 2, 9] and np.array_equal(v, vals[:3])


# -- owned rows and the hash bitmap ------------------------------------------------------------------------------
def test_owned_rows_cover_the_table_once():
    for R, n in ((1, 2), (15, 3), (1000, 4), (4099, 7)):
        o = zen.OwnedRows(R, n, 77)
        parts = [o.owned(j) for j in range(n)]
        assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(R))
        for j, p in enumerate(parts):
            assert np.all(np.diff(p) > 0)
            assert np.all(owner_of(p.astype(np.int64), n, 77) == j)
    assert zen.owned_rows(1000, 4, 77) is zen.owned_rows(1000, 4, 77)


class _Fixed:
    """An OwnedRows with given I_j lists (for the paper's example)."""

    def __init__(self, parts):
        self.parts = [np.asarray(p, np.int64) for p in parts]

    def owned(self, j):
        return self.parts[j]


def test_hash_bitmap_paper_example():
    # |G| = 15 over 3 servers; I_0 holds global rows 5 and 7 at positions 2 and 3; they are the non-zeros
    owned = [np.array([0, 3, 5, 7, 10]), np.array([1, 4, 8, 11, 13]), np.array([2, 6, 9, 12, 14])]
    bits = zen.encode_bitmap(owned[0], np.array([5, 7]))
    assert bits.tolist() == [0b00001100]  # bits 2 and 3
    assert zen.decode_bitmap(owned[0], bits).tolist() == [5, 7]
    assert sum((p.size + 7) // 8 for p in owned) == 3


def test_hash_bitmap_round_trips():
    rng = np.random.default_rng(3)
    for size in (0, 1, 7, 8, 9, 63, 64, 65, 1001):
        owned = np.sort(rng.choice(10 ** 6, size, replace=False))
        for present in (owned[:0], owned, owned[rng.random(size) < 0.3]):
            bits = zen.encode_bitmap(owned, present)
            assert bits.size == (size + 7) // 8
            assert np.array_equal(zen.decode_bitmap(owned, bits), present)
    o = zen.OwnedRows(100003, 16, 1)
    assert sum((o.count(j) + 7) // 8 for j in range(16)) <= 100003 // 8 + 16


# -- imbalance ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 4, 8, 16])
@pytest.mark.parametrize("dist", ["uniform", "zipf"])
def test_zen_imbalance_is_small(n, dist):
    rng = np.random.default_rng(n)
    seeds = Seeds(11)
    counts = []
    for rank in range(n):
        if dist == "uniform":
            rows = np.unique(rng.integers(0, 10 ** 7, 120000))
        else:  # heavy skew: most rows near the start of the table
            rows = np.unique(rng.zipf(1.1, 400000) - 1)
            rows = rows[rows < 10 ** 9]
        assert rows.size >= 100000
        counts.append(zen.bucket_partition(rows, n, seeds.h0)[1])
    c = np.array(counts).T  # c[j, i]: rows rank i sends to owner j
    assert zen.push_imbalance(c) <= 1.1
    assert zen.pull_imbalance(c.sum(axis=1)) <= 1.1
    if dist == "zipf":  # contiguous ranges (Sparse PS) are far worse on the same rows
        bounds = np.linspace(0, rows.max() + 1, n + 1)
        contiguous = np.histogram(rows, bounds)[0]
        assert n * contiguous.max() / rows.size > 1.5


def test_imbalance_edge_cases():
    assert zen.push_imbalance(np.zeros((3, 3))) == 1.0
    assert zen.pull_imbalance(np.zeros(3)) == 1.0
    assert zen.push_imbalance(np.array([[4, 0], [0, 0]])) == 2.0


# -- message formats, with ranks simulated ----------------------------------------------------------------------
def _rank_input(rank, R, W, m, rng_seed=0, dtype=np.float32):
    rng = np.random.default_rng(rng_seed * 1000 + rank)
    rows = rng.integers(0, R, m) if m else np.zeros(0, np.int64)
    if m:
        rows[0] = 0
        rows[-1] = R - 1
    vals = rng.integers(-8, 8, (m, W)).astype(dtype)
    return rows, vals


def _dense_sum(inputs, R, W, dtype):
    ref = np.zeros((R, W), dtype)
    for rows, vals in inputs:
        np.add.at(ref, rows, vals)
    return ref


def _simulate_zen(inputs, R, W, n, dtype, method="bucket", bitmaps=True):
    seeds = Seeds(99)
    tables = [_format.Table("t", R, (W,), dtype, 1, "zen", seeds.h0) for _ in range(n)]
    blocks = []
    for rank, (rows, vals) in enumerate(inputs):
        r, v = zen.coalesce(rows, vals)
        perm, counts, _ = zen.partition(r, n, seeds, method, k=3)
        w = zen.pack_push(tables[rank], r, v, perm, counts, rank)
        assert sum(w.block_sizes) == w.buf.size and all(b % 8 == 0 for b in w.block_sizes)
        starts = np.concatenate([[0], np.cumsum(w.block_sizes)])
        blocks.append([w.buf[starts[j]:starts[j + 1]] for j in range(n)])
    owned = zen.owned_rows(R, n, seeds.h0) if bitmaps else None
    blobs = []
    for j in range(n):  # the alltoall: owner j gets block j of every rank
        got = [blocks[i][j] for i in range(n)]
        buf = np.concatenate(got)
        union, sums, counts_from, _ = zen.aggregate(tables[j], buf, [b.size for b in got])
        blobs.append(zen.pack_pull(tables[j], owned.owned(j) if bitmaps else None, union, sums, counts_from, j))
    buf = np.concatenate(blobs)  # the allgather
    rows_parts, value_parts, counts, index_bytes = zen.unpack_pull(tables[0], buf, [b.size for b in blobs], owned)
    rows, values = zen.assemble(rows_parts, value_parts, W, dtype)
    return rows, values, counts, index_bytes


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("case", ["sparse", "dense", "one_empty", "all_empty", "single"])
@pytest.mark.parametrize("method", ["bucket", "hash"])
def test_zen_messages_give_the_dense_sum(n, case, method):
    R, W = 997, 3
    m = {"sparse": 20, "dense": 3000, "one_empty": 50, "all_empty": 0, "single": 1}[case]
    inputs = [_rank_input(r, R, W, 0 if (case == "one_empty" and r == 1) else m) for r in range(n)]
    rows, values, counts, index_bytes = _simulate_zen(inputs, R, W, n, np.float32, method)
    ref = _dense_sum(inputs, R, W, np.float32)
    present = np.unique(np.concatenate([r for r, _ in inputs])) if m else np.zeros(0, np.int64)
    assert np.array_equal(rows, present)  # the rows some rank had, sorted
    dense = np.zeros((R, W), np.float32)
    dense[rows] = values
    assert np.array_equal(dense, ref)  # bit for bit: integer values
    assert counts.sum(axis=0).tolist() == [np.unique(r).size for r, _ in inputs]
    assert index_bytes <= R // 8 + n


def test_allgather_messages_and_mismatch():
    R, W, n = 50, 2, 3
    inputs = [_rank_input(r, R, W, 5 + r) for r in range(n)]
    tables = [_format.Table("emb", R, (W,), np.float32, 1, "allgather") for _ in range(n)]
    blobs = [allgather.pack(tables[r], *zen.coalesce(*inputs[r]), r) for r in range(n)]
    rows, values, counts, _ = allgather.unpack(tables[0], np.concatenate(blobs), [b.size for b in blobs])
    dense = np.zeros((R, W), np.float32)
    np.add.at(dense, rows, values)
    assert np.array_equal(dense, _dense_sum(inputs, R, W, np.float32))
    other = _format.Table("emb", R + 1, (W,), np.float32, 1, "allgather")
    blobs[2] = allgather.pack(other, *zen.coalesce(*inputs[2]), 2)
    with pytest.raises(MismatchError, match="'emb'.*51 rows"):
        allgather.unpack(tables[0], np.concatenate(blobs), [b.size for b in blobs])
    for bad in (_format.Table("emb", R, (W,), np.float64, 1, "allgather"), _format.Table("emb", R, (W,), np.float32, 0,
                                                                                         "allgather"),
                _format.Table("emb", R, (W,), np.float32, 1, "zen")):
        blobs[2] = allgather.pack(bad, *zen.coalesce(*inputs[2]), 2)
        with pytest.raises(MismatchError, match="disagree"):
            allgather.unpack(tables[0], np.concatenate(blobs), [b.size for b in blobs])


def test_pull_uses_row_ids_when_smaller_than_the_bitmap():
    R, W, n = 1 << 20, 1, 2
    inputs = [(np.array([3, 70000]), np.ones((2, 1), np.float32)), (np.array([3]), np.ones((1, 1), np.float32))]
    rows, values, counts, index_bytes = _simulate_zen(inputs, R, W, n, np.float32)
    assert rows.tolist() == [3, 70000] and values.ravel().tolist() == [2.0, 1.0]
    assert index_bytes == 4 * 2  # two int32 ids instead of R/8 bytes of bitmaps


def test_pull_without_bitmaps_for_huge_tables():
    R, W, n = 1 << 40, 2, 3  # no I_j lists for such a table: owners send row ids
    inputs = [(np.array([5 + r, R - 1 - r, (1 << 33) + r % 2]), np.full((3, W), r + 1, np.float32)) for r in range(n)]
    rows, values, counts, index_bytes = _simulate_zen(inputs, R, W, n, np.float32, bitmaps=False)
    want = {}
    for r_rows, v in inputs:
        for row, val in zip(r_rows.tolist(), v):
            want[row % R] = want.get(row % R, 0) + val[0]
    assert rows.tolist() == sorted(want) and values[:, 0].tolist() == [want[k] for k in sorted(want)]
    assert index_bytes == 8 * rows.size  # int64 ids


# -- the cost model -----------------------------------------------------------------------------------------------
LINK = choice.Link(latency=50e-6, beta=8 / 10e9, gamma=1e-10, delta=1e-8)


def _work(n, R, W, per_rank, union, **kw):
    return choice.Workload(ranks=n, rows=R, row_bytes=4 * W, width=W, total=n * per_rank, nnz_max=per_rank,
                           nnz_min=per_rank, union=union, **kw)


def test_cost_model_choices():
    # nearly every row on every rank: dense
    assert choice.choose(_work(4, 1000, 64, 900, 1000), LINK)[0] == "dense"
    # 1% of a large table per rank, overlapping, at 8 ranks: zen
    best, preds = choice.choose(_work(8, 10 ** 6, 64, 10000, 12000), LINK)
    assert best == "zen"
    assert preds["allgather"].wire_bytes > 3 * preds["zen"].wire_bytes
    # a handful of rows: one collective beats two
    assert choice.choose(_work(2, 10 ** 6, 16, 20, 30), LINK)[0] == "allgather"
    # a measured Zen imbalance far from 1 and wide rows: the column partition is balanced by construction
    assert choice.choose(_work(4, 10 ** 6, 1024, 4000, 12000, imbalance=3.0), LINK)[0] == "alltoall"
    # no table size: only allgather applies
    w = choice.Workload(ranks=4, rows=-1, row_bytes=64, total=400, nnz_max=100, nnz_min=100, union=300)
    best, preds = choice.choose(w, LINK)
    assert best == "allgather" and set(preds) == {"allgather"}


def test_cost_model_byte_formulas():
    n, R, W, m, U = 4, 100000, 16, 1000, 3000
    p = choice.predict(_work(n, R, W, m, U), choice.Link(latency=0, beta=1.0, gamma=0, delta=0))
    f = (n - 1) / n
    assert p["dense"].wire_bytes == pytest.approx(2 * f * R * (4 * W + 4))
    h = 8 * _format.HEADER
    assert p["allgather"].wire_bytes == pytest.approx((n - 1) * m * (4 + 4 * W) + (n - 1) * h)
    push = (n * m - m) / n * (4 + 4 * W) + (n - 1) * h
    pull = f * (min(R / 8, 4 * U) + U * 4 * W) + (n - 1) * (h + 8 * (n + 3))
    assert p["zen"].wire_bytes == pytest.approx(push + pull)
    assert all(v.seconds == pytest.approx(v.wire_bytes) for v in p.values())


def test_choice_hysteresis_and_policy():
    w = _work(4, 10 ** 5, 16, 1000, 3000)
    best, preds = choice.choose(w, LINK)
    second = sorted(preds, key=lambda a: preds[a].seconds)[1]
    if preds[second].seconds < preds[best].seconds / (1 - 0.05):
        assert choice.choose(w, LINK, current=second)[0] == second
    assert choice.choose(w, LINK, current=best)[0] == best
    assert choice.choose(w, LINK, allowed=["dense"])[0] == "dense"
    try:
        choice.set_policy("alltoall")
        assert choice.policy() == "alltoall"
        with pytest.raises(ValueError):
            choice.set_policy("fastest")
    finally:
        choice.set_policy(None)
    assert choice.policy() is None


def test_choose_measured_explores_then_trusts_measurements():
    w = _work(4, 20000, 64, 5000, 12000)
    preds = choice.predict(w, LINK)
    best = min(preds, key=lambda a: preds[a].seconds)
    window = [a for a in preds if preds[a].seconds <= choice.EXPLORE_WINDOW * preds[best].seconds]
    tried, corr, order = {}, {}, []
    for _ in range(choice.EXPLORE_SAMPLES * len(window)):
        alg, how, _ = choice.choose_measured(preds, corr, tried)
        assert how == "explore" and alg in window
        tried[alg] = tried.get(alg, 0) + 1
        order.append(alg)
    assert sorted(set(order)) == sorted(window) and order[0] == best
    # measurements say the model's favourite is 3x slower than predicted, the others as predicted
    corr = {a: (3.0 if a == best else 1.0) for a in window}
    alg, how, est = choice.choose_measured(preds, corr, tried)
    assert how == "auto"
    assert alg == min(window, key=lambda a: preds[a].seconds * corr[a])
    assert est[best] == pytest.approx(3 * preds[best].seconds)
    # algorithms outside the window are never run
    far = [a for a in preds if a not in window]
    assert all(a not in est for a in far)


def test_sparse_knobs():
    assert knob("sparse_algorithm").default == "auto"
    assert set(knob("sparse_algorithm").choices) == set(choice.CHOICES)
    assert knob("zen_hash_funcs").default == 3
    assert knob("zen_load_factor").default == 0.5
    assert knob("zen_serial_fraction").default == 0.1
    assert knob("zen_partitioner").default == "bucket"
