"""Unit tests of the communicating compressors (perseus.compression) without MPI: selectors, and each
compressor's encode/decode arithmetic with the collectives done by hand for 1 to 3 simulated ranks
(an allgather is a concatenation, an allreduce a sum in rank order)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from perseus.base.exceptions import HorovodInternalError, MismatchError
from perseus.compression import PowerSGD, QSGD, RandomK, Reducer, Sign, TopK
from perseus.compression import selectors
from perseus.compression.base import CHECK_LEN, KeyState, put_check, verify_check
from perseus.compression.qsgd import pack4, unpack4

pytestmark = pytest.mark.timeout(60)


def state(key, shapes, rank=0, size=1):
    n = int(sum(np.prod(s, dtype=np.int64) for s in shapes))
    st = KeyState(n, tuple(tuple(s) for s in shapes), key)
    st.set_size, st.rank = size, rank
    return st


def grads(size, n, step=0, seed=0):
    return [np.random.default_rng([seed, r, step]).standard_normal(n).astype(np.float32) for r in range(size)]


def gather(payloads):
    return np.concatenate(payloads), [p.size for p in payloads]


def simulate_gather(reducers, states, inputs):
    """One step of an allgather compressor over len(inputs) simulated ranks: ``(results, accs before,
    payloads)``; ``accs before`` is what each rank had to send (gradient + residual)."""
    befores, payloads, ctxs = [], [], []
    for red, st, g in zip(reducers, states, inputs):
        acc = red._accumulate(st, [g], 1.0)
        befores.append(acc.copy())
        payload, ctx = red._encode(acc, st)
        st.step += 1
        payloads.append(payload.copy())
        ctxs.append(ctx)
    data, splits = gather(payloads)
    results = [red._decode(data, splits, ctx, st).copy() for red, st, ctx in zip(reducers, states, ctxs)]
    return results, befores, payloads


# -- selectors ---------------------------------------------------------------------------------------------

def distinct_magnitudes(n, seed=0):
    return np.random.default_rng(seed).permutation(n).astype(np.float32) + 1.0


@pytest.mark.parametrize("name", list(selectors.SELECTORS))
@pytest.mark.parametrize("n", [1, 7, 1000, 1 << 17])
def test_selectors_return_exactly_k_distinct_indices(name, n):
    mag = np.abs(np.random.default_rng(n).standard_normal(n).astype(np.float32))
    for k in sorted({1, max(1, n // 100), max(1, n // 2), max(1, n - 1), n}):
        idx = np.asarray(selectors.select(mag, k, name))
        assert idx.size == k, (name, n, k)
        assert np.unique(idx).size == k
        assert idx.min() >= 0 and idx.max() < n


@pytest.mark.parametrize("name", list(selectors.SELECTORS))
def test_selectors_with_ties_and_zeros(name):
    mag = np.zeros(5000, np.float32)
    assert np.unique(selectors.select(mag, 37, name)).size == 37
    mag = np.random.default_rng(1).integers(0, 3, 5000).astype(np.float32)
    for k in (1, 100, 1700, 4999):
        idx = selectors.select(mag, k, name)
        assert np.unique(idx).size == k
        if name != "mstopk":
            assert np.sort(mag[idx])[0] >= np.sort(mag)[-k]


@pytest.mark.parametrize("name", [s for s in selectors.SELECTORS if s != "mstopk"])
@pytest.mark.parametrize("n", [1000, 1 << 17])
def test_exact_selectors_give_the_true_top_k(name, n):
    mag = distinct_magnitudes(n, seed=n)
    for k in (1, n // 100, n // 10):
        want = set(np.argsort(mag)[n - k:].tolist())
        assert set(np.asarray(selectors.select(mag, k, name)).tolist()) == want


@pytest.mark.parametrize("n", [1000, 1 << 17])
def test_mstopk_is_close_to_the_top_k(n):
    mag = np.abs(np.random.default_rng(n).standard_normal(n).astype(np.float32))
    for k in (n // 100, n // 10):
        idx = selectors.select(mag, k, "mstopk")
        assert np.unique(idx).size == k
        exact = np.sort(mag)[n - k:]
        assert mag[idx].sum() >= 0.97 * exact.sum()
        assert mag[idx].min() >= 0.9 * exact[0]


def test_choice_names_a_selector_and_rejects_unknown_ones():
    assert selectors.choice(100, 0.1) in selectors.SELECTORS
    assert selectors.choice(1 << 20, 0.01, "exact") == "exact"
    with pytest.raises(ValueError, match="unknown top-k selector"):
        selectors.choice(100, 0.1, "nope")


# -- argument validation -----------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda: TopK(0), lambda: TopK(1.5), lambda: TopK(-0.1), lambda: TopK(0.1, selector="nope"),
    lambda: RandomK(0), lambda: RandomK(1.01), lambda: RandomK(0.1, seed=-1), lambda: RandomK(0.1, seed=1.5),
    lambda: QSGD(0), lambda: QSGD(128), lambda: QSGD(2.5), lambda: QSGD(seed=-3),
    lambda: PowerSGD(0), lambda: PowerSGD(-1), lambda: PowerSGD(1.5), lambda: PowerSGD(2, min_compression_rate=0),
    lambda: PowerSGD(2, seed=-1),
])
def test_bad_arguments_raise_value_error(make):
    with pytest.raises(ValueError, match="perseus"):
        make()


def test_defaults_and_repr():
    assert TopK(0.1).error_feedback and RandomK(0.1).error_feedback and Sign().error_feedback
    assert PowerSGD().error_feedback and not QSGD().error_feedback
    assert QSGD(error_feedback=True).error_feedback and not Sign(error_feedback=False).error_feedback
    assert "levels=127" in repr(QSGD()) and "rank=4" in repr(PowerSGD()) and "density=0.5" in repr(RandomK(0.5))


@pytest.mark.parametrize("cls", [TopK, RandomK, Sign, QSGD, PowerSGD])
def test_not_a_plain_compressor(cls):
    red = cls(0.5) if cls in (TopK, RandomK) else cls()
    with pytest.raises(TypeError, match="own collective"):
        red.compress(np.zeros(3, np.float32))
    with pytest.raises(TypeError, match="own collective"):
        red.decompress(np.zeros(3, np.float32), None)
    with pytest.raises(TypeError, match="pass an instance"):
        cls.compress(np.zeros(3, np.float32))


def test_namespaces_name_every_reducer():
    from perseus.compression import REDUCERS

    for name in ("topk", "randomk", "sign", "qsgd", "powersgd"):
        assert issubclass(REDUCERS[name], Reducer) and REDUCERS[name].kind == name


# -- the size check ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [1, 2, 3, 5, 64])
def test_check_tells_every_rank(size):
    rng = np.random.default_rng(size)
    for trial in range(200):
        sigs = [int(rng.integers(0, 2 ** 32))] * size
        if trial % 2 and size > 1:  # some ranks differ, possibly only in one hex digit
            for r in rng.choice(size, int(rng.integers(1, size)), replace=False):
                sigs[r] ^= (1 << int(rng.integers(0, 32))) if trial % 4 == 1 else int(rng.integers(1, 2 ** 32))
        bufs = [np.empty(CHECK_LEN, np.float32) for _ in sigs]
        for b, s in zip(bufs, sigs):
            put_check(b, s)
        summed = np.sum(bufs, axis=0, dtype=np.float32)
        agree = len(set(sigs)) == 1
        assert [verify_check(summed, s, size) for s in sigs] == [agree] * size


def test_mismatch_error_is_a_horovod_internal_error():
    st = state("k", [(3,)])
    err = TopK(0.5)._mismatch(st, "the size")
    assert isinstance(err, MismatchError) and isinstance(err, HorovodInternalError)
    assert "'k'" in str(err) and "(3,)" in str(err)


# -- top-k -------------------------------------------------------------------------------------------------

def test_topk_two_ranks_error_feedback_and_sum():
    reds = [TopK(0.1, selector="exact") for _ in range(3)]
    sts = [state("t", [(1000,)], r, 3) for r in range(3)]
    for step in range(3):
        results, befores, payloads = simulate_gather(reds, sts, grads(3, 1000, step))
        owns = []
        for st, before, p in zip(sts, befores, payloads):
            k = (p.size - 1) // 2
            assert k == 100
            own = np.zeros(1000, np.float32)
            own[p[k:2 * k].view(np.int32)] = p[:k]
            owns.append(own)
            assert np.array_equal(own + st.residual, before)
            assert set(np.flatnonzero(own).tolist()) == set(np.argsort(np.abs(before))[-k:].tolist())
        total = np.zeros(1000, np.float32)
        for own in owns:
            total += own
        for res in results:
            assert np.array_equal(res, total)


def test_topk_size_mismatch_raises_on_every_rank():
    # 1000 and 999 entries both send k = 100 at density 0.1: only the signature tells them apart
    reds = [TopK(0.1, selector="exact") for _ in range(2)]
    sts = [state("t", [(1000,)], 0, 2), state("t", [(999,)], 1, 2)]
    payloads = []
    for red, st in zip(reds, sts):
        acc = red._accumulate(st, [np.ones(st.size, np.float32)], 1.0)
        payloads.append(red._encode(acc, st)[0])
    assert payloads[0].size == payloads[1].size
    data, splits = gather(payloads)
    for red, st in zip(reds, sts):
        with pytest.raises(MismatchError, match="disagree"):
            red._decode(data, splits, None, st)


# -- random-k ----------------------------------------------------------------------------------------------

def test_randomk_indices():
    red = RandomK(0.01, seed=3)
    a = red.indices("w", 100_000, 5)
    assert a.size == 1000 and np.unique(a).size == 1000 and np.all(np.diff(a) > 0)
    assert a.min() >= 0 and a.max() < 100_000
    assert np.array_equal(a, RandomK(0.01, seed=3).indices("w", 100_000, 5))  # another rank
    assert not np.array_equal(a, red.indices("w", 100_000, 6))
    assert not np.array_equal(a, red.indices("v", 100_000, 5))
    assert not np.array_equal(a, RandomK(0.01, seed=4).indices("w", 100_000, 5))
    assert red.k_of(0) == 0 and red.k_of(1) == 1 and red.k_of(101) == 2
    assert np.array_equal(RandomK(1.0).indices("w", 10, 0), np.arange(10))
    # over many steps every coordinate gets its turn about equally often
    counts = np.bincount(np.concatenate([RandomK(0.1).indices("w", 50, s) for s in range(2000)]), minlength=50)
    assert counts.min() > 0.7 * 2000 * 5 / 50


def simulate_randomk(reds, sts, inputs):
    befores, payloads, ctxs = [], [], []
    for red, st, g in zip(reds, sts, inputs):
        acc = red._accumulate(st, [g], 1.0)
        befores.append(acc.copy())
        payload, ctx = red._encode(acc, st)
        st.step += 1
        payloads.append(payload.copy())
        ctxs.append(ctx)
    summed = np.zeros_like(payloads[0])
    for p in payloads:
        summed += p
    return [red._decode(summed, None, ctx, st).copy() for red, st, ctx in zip(reds, sts, ctxs)], befores, \
        payloads, ctxs


def test_randomk_error_feedback_and_sum():
    reds = [RandomK(0.05, seed=7) for _ in range(3)]
    sts = [state("r", [(400,)], r, 3) for r in range(3)]
    for step in range(4):
        results, befores, payloads, ctxs = simulate_randomk(reds, sts, grads(3, 400, step))
        assert all(np.array_equal(ctxs[0], c) for c in ctxs)
        total = np.zeros(400, np.float32)
        for st, before, p, idx in zip(sts, befores, payloads, ctxs):
            own = np.zeros(400, np.float32)
            own[idx] = p[:idx.size]
            assert np.array_equal(own + st.residual, before)
            assert np.array_equal(own[idx], before[idx]) and not st.residual[idx].any()
            total += own
        for res in results:
            np.testing.assert_allclose(res, total, rtol=1e-6, atol=1e-6)


def test_randomk_size_mismatch_raises_on_every_rank():
    # 1000 and 999 entries both send k = 100 at density 0.1: only the check tells them apart
    reds = [RandomK(0.1) for _ in range(2)]
    sts = [state("r", [(1000,)], 0, 2), state("r", [(999,)], 1, 2)]
    payloads, ctxs = [], []
    for red, st in zip(reds, sts):
        payload, ctx = red._encode(red._accumulate(st, [np.ones(st.size, np.float32)], 1.0), st)
        payloads.append(payload)
        ctxs.append(ctx)
    assert payloads[0].size == payloads[1].size
    summed = payloads[0] + payloads[1]
    for red, st, ctx in zip(reds, sts, ctxs):
        with pytest.raises(MismatchError, match="disagree"):
            red._decode(summed, None, ctx, st)


# -- sign --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 8, 13, 1000])
def test_sign_payload_round_trip(n):
    red = Sign()
    st = state("s", [(n,)])
    g = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    g[::3] = 0.0  # zero counts as +1
    acc = red._accumulate(st, [g], 1.0)
    before = acc.copy()
    payload, _ = red._encode(acc, st)
    nb = (n + 7) // 8
    assert payload.dtype == np.uint8 and payload.size == nb + 8
    bits = np.unpackbits(payload[:nb], count=n).astype(bool)
    assert np.array_equal(bits, before >= 0)
    scale = payload[nb:nb + 4].view(np.float32)[0]
    assert scale == np.float32(np.abs(before).astype(np.float64).mean())
    own = np.where(bits, scale, -scale).astype(np.float32)
    assert np.array_equal(st.residual, before - own)
    np.testing.assert_allclose(own + st.residual, before, atol=1e-6)
    assert np.array_equal(red._decode(payload, [payload.size], None, st), own)


def test_sign_three_ranks_sum_in_rank_order():
    reds = [Sign() for _ in range(3)]
    sts = [state("s", [(77,)], r, 3) for r in range(3)]
    for step in range(3):
        results, befores, payloads = simulate_gather(reds, sts, grads(3, 77, step))
        total = np.zeros(77, np.float32)
        for st, before, p in zip(sts, befores, payloads):
            bits = np.unpackbits(p[:10], count=77).astype(bool)
            s = p[10:14].view(np.float32)[0]
            own = np.where(bits, s, -s).astype(np.float32)
            assert np.array_equal(st.residual, before - own)
            total += own
        for res in results:
            assert np.array_equal(res, total)


def test_sign_size_mismatch():
    reds = [Sign(), Sign()]
    sts = [state("s", [(10,)], 0, 2), state("s", [(12,)], 1, 2)]  # both pack into 2 bytes
    with pytest.raises(MismatchError):
        simulate_gather(reds, sts, [np.ones(10, np.float32), np.ones(12, np.float32)])


# -- QSGD --------------------------------------------------------------------------------------------------

def test_pack4_round_trip():
    q = np.tile(np.arange(-8, 8, dtype=np.int8), 3)
    packed = pack4(q, np.empty(q.size // 2, np.uint8), np.empty(q.size // 2, np.uint8))
    assert np.array_equal(unpack4(packed, np.empty(q.size, np.int8)), q)


@pytest.mark.parametrize("levels", [1, 4, 7, 8, 127])
def test_qsgd_payload_and_levels(levels):
    red = QSGD(levels, error_feedback=True)
    n = 101
    st = state("q", [(n,)])
    acc = red._accumulate(st, [np.random.default_rng(0).standard_normal(n).astype(np.float32)], 1.0)
    before = acc.copy()
    payload, _ = red._encode(acc, st)
    nb = (n + 1) // 2 if levels <= 7 else n
    assert payload.size == nb + 8
    own = red._values(payload, n, st.extra, np.empty(n, np.float32))
    scale = payload[nb:nb + 4].view(np.float32)[0]
    np.testing.assert_allclose(scale, np.linalg.norm(before.astype(np.float64)) / levels, rtol=1e-6)
    q = own / scale
    assert np.array_equal(q, np.round(q)) and np.abs(q).max() <= levels
    assert np.all((q == 0) | (np.sign(q) == np.sign(before)))
    # stochastic rounding goes to one of the two neighbouring levels
    r = np.abs(before) / np.linalg.norm(before) * levels
    assert np.all((np.abs(q) == np.floor(r)) | (np.abs(q) == np.floor(r) + 1))
    assert np.array_equal(st.residual, before - own)


@pytest.mark.parametrize("levels", [2, 127])
def test_qsgd_is_unbiased(levels):
    n, trials = 40, 3000
    x = np.random.default_rng(5).standard_normal(n).astype(np.float32)
    red = QSGD(levels)
    st = state("q", [(n,)])
    total = np.zeros(n, np.float64)
    for step in range(trials):
        st.step = step
        acc = red._accumulate(st, [x], 1.0)
        payload, _ = red._encode(acc, st)
        total += red._decode(payload, [payload.size], None, st)
    mean = total / trials
    # per-entry standard deviation of one draw is at most norm / levels / 2
    bound = 5 * np.linalg.norm(x) / levels / 2 / math.sqrt(trials)
    assert np.abs(mean - x).max() < bound
    assert red.residual("q") is None


def test_qsgd_ranks_and_steps_draw_differently():
    n = 200
    x = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    payloads = []
    for rank, step in [(0, 0), (1, 0), (0, 1)]:
        red = QSGD(3)
        st = state("q", [(n,)], rank, 2)
        st.step = step
        payloads.append(red._encode(red._accumulate(st, [x], 1.0), st)[0].copy())
    assert not np.array_equal(payloads[0], payloads[1]) and not np.array_equal(payloads[0], payloads[2])
    st = state("q", [(n,)], 0, 2)
    red = QSGD(3)
    assert np.array_equal(red._encode(red._accumulate(st, [x], 1.0), st)[0], payloads[0])  # reproducible


def test_qsgd_zero_and_three_ranks():
    reds = [QSGD(5, error_feedback=True) for _ in range(3)]
    sts = [state("q", [(33,)], r, 3) for r in range(3)]
    inputs = grads(3, 33)
    inputs[1][:] = 0.0
    results, befores, payloads = simulate_gather(reds, sts, inputs)
    total = np.zeros(33, np.float32)
    for red, st, before, p in zip(reds, sts, befores, payloads):
        own = red._values(p, 33, st.extra, np.empty(33, np.float32))
        assert np.array_equal(st.residual, before - own)
        total += own
    for res in results:
        assert np.array_equal(res, total)
    with pytest.raises(MismatchError):  # same payload length, other levels
        a, b = QSGD(5), QSGD(6)
        sa, sb = state("q", [(33,)], 0, 2), state("q", [(33,)], 1, 2)
        simulate_gather([a, b], [sa, sb], grads(2, 33))


# -- PowerSGD ----------------------------------------------------------------------------------------------

def simulate_powersgd(reds, sts, inputs):
    """One step over the simulated ranks; inputs[r] is a list of arrays. Returns (results, befores, owns):
    owns[r] is what rank r contributed (P^ Q_r^T for the matrices, the dense parts as they were)."""
    accs, befores = [], []
    for red, st, arrays in zip(reds, sts, inputs):
        acc = red._accumulate(st, arrays, 1.0)
        befores.append(acc.copy())
        accs.append(acc)
    sends = [red.round1(acc, st).copy() for red, st, acc in zip(reds, sts, accs)]
    for st in sts:
        st.step += 1
        st.extra["recv1"][:] = np.sum(sends, axis=0, dtype=np.float32)
    for red, st in zip(reds, sts):
        red.check(st)
    sends = [red.round2(acc, st).copy() for red, st, acc in zip(reds, sts, accs)]
    owns = []
    for red, st, before in zip(reds, sts, befores):
        plan = st.extra["plan"]
        own = before.copy()
        for i, (off, rows, cols, r, p_off, q_off) in enumerate(plan.mats):
            p = st.extra["recv1"][p_off:p_off + rows * r].reshape(rows, r)
            q = st.extra["send2"][q_off:q_off + cols * r].reshape(cols, r)
            own[off:off + rows * cols] = (p @ q.T).reshape(-1)
        owns.append(own)
    for red, st, acc in zip(reds, sts, accs):
        if red.error_feedback:
            red.feedback(acc, st)
        st.extra["q"][:] = np.sum(sends, axis=0, dtype=np.float32)
    return [red.result(st).copy() for red, st in zip(reds, sts)], befores, owns


def test_powersgd_plan():
    red = PowerSGD(rank=4, min_compression_rate=2)
    st = state("p", [(64, 3, 3, 3), (64,), (10, 10), (3, 100), (200, 50)])
    plan = red.plan(st)
    # (64, 27): 1728 >= 2 * 91 * 4: compressed; (64,): dense; (10, 10): 100 < 2 * 20 * 4: dense;
    # (3, 100): r = 3, 300 >= 2 * 103 * 3 fails: dense; (200, 50): compressed
    assert [(m[1], m[2], m[3]) for m in plan.mats] == [(64, 27, 4), (200, 50, 4)]
    assert plan.p_len == (64 + 200) * 4 and plan.q_len == (27 + 50) * 4
    assert plan.dense == [(1728, 64 + 100 + 300, 264 * 4)] and plan.dense_len == 464
    assert red.plan(state("p", [(30,)])).mats == []
    assert PowerSGD(rank=40, min_compression_rate=0.5).plan(state("p", [(8, 1000)])).mats[0][3] == 8  # r <= rows


def test_powersgd_exact_for_low_rank_sums():
    rows, cols = 40, 30
    rng = np.random.default_rng(0)
    # each rank's matrix has rank 1, their sum rank 2: rank-2 PowerSGD recovers the sum exactly
    mats = [np.outer(rng.standard_normal(rows), rng.standard_normal(cols)).astype(np.float32) for _ in range(2)]
    for rank in (2, 3):
        reds = [PowerSGD(rank=rank, error_feedback=False) for _ in range(2)]
        sts = [state("p", [(rows, cols)], r, 2) for r in range(2)]
        for step in range(3):
            results, _, _ = simulate_powersgd(reds, sts, [[m] for m in mats])
            for res in results:
                np.testing.assert_allclose(res.reshape(rows, cols), mats[0] + mats[1], rtol=1e-4, atol=1e-4)


def test_powersgd_power_iterations_reach_the_best_rank_r_approximation():
    rng = np.random.default_rng(3)
    u, _ = np.linalg.qr(rng.standard_normal((50, 50)))
    v, _ = np.linalg.qr(rng.standard_normal((40, 40)))
    s = np.array([10.0, 8.0, 6.0] + [0.5] * 37)
    m = (u[:, :40] * s) @ v.T
    m = m.astype(np.float32)
    red = PowerSGD(rank=3, error_feedback=False)
    st = state("p", [(50, 40)])
    for _ in range(15):
        (res,), _, _ = simulate_powersgd([red], [st], [[m]])
    best = np.sqrt(np.sum(s[3:] ** 2))
    assert np.linalg.norm(res.reshape(50, 40) - m) <= 1.01 * best


def test_powersgd_error_feedback_and_sum():
    shapes = [(24, 16), (5,), (6, 2, 10), (4, 4)]
    reds = [PowerSGD(rank=2, seed=9) for _ in range(3)]
    sts = [state("p", shapes, r, 3) for r in range(3)]
    rng = np.random.default_rng(0)
    for step in range(3):
        inputs = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(3)]
        results, befores, owns = simulate_powersgd(reds, sts, inputs)
        for st, before, own in zip(sts, befores, owns):
            assert np.array_equal(st.residual, before - own)
        total = np.sum(owns, axis=0, dtype=np.float32)
        for res in results:
            assert np.array_equal(res, results[0])
            np.testing.assert_allclose(res, total, rtol=1e-5, atol=1e-5)
        # the dense parts ((5,) and (4, 4)) arrive exactly and leave no residual
        for off, length in [(384, 5), (389 + 120, 16)]:
            assert not sts[0].residual[off:off + length].any()


def test_powersgd_recovers_from_a_zero_gradient():
    red = PowerSGD(rank=2, error_feedback=False)
    st = state("p", [(20, 20)])
    simulate_powersgd([red], [st], [[np.zeros((20, 20), np.float32)]])
    assert not st.extra["q"].any()
    m = np.outer(np.arange(20), np.ones(20)).astype(np.float32)
    (res,), _, _ = simulate_powersgd([red], [st], [[m]])
    np.testing.assert_allclose(res.reshape(20, 20), m, rtol=1e-4, atol=1e-3)


def test_powersgd_shape_mismatch_raises_on_every_rank():
    # (20, 30) and (20, 31) send P of the same size: only the check tells them apart
    for shapes, other in [([(20, 30)], [(20, 31)]), ([(20, 30)], [(20, 30)])]:
        reds = [PowerSGD(rank=2), PowerSGD(rank=2 if shapes != other else 3, min_compression_rate=1)]
        sts = [state("p", shapes, 0, 2), state("p", other, 1, 2)]
        sends = [red.round1(red._accumulate(st, [np.ones(st.shapes[0], np.float32)], 1.0), st)
                 for red, st in zip(reds, sts)]
        if sends[0].size != sends[1].size:  # another rank: the engine reports it
            continue
        for st in sts:
            st.extra["recv1"][:] = sends[0] + sends[1]
        for red, st in zip(reds, sts):
            with pytest.raises(MismatchError, match="shapes"):
                red.check(st)
