"""The planners behind Compression.cupcake and Compression.espresso, without a job: Cupcake's fusion DP
against brute force, its degenerate cases and speed; Espresso's timeline simulator, cost formulas and
decision on hand-built timelines; the wrappers' grouping logic over a local stand-in compressor."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from perseus.compression.base import KeyState, Pending, Reducer
from perseus.compression.cupcake import (Cupcake, StepProfiler, fit_affine, merge_residuals, plan_fusion,
                                         plan_fusion_brute_force, simulate)
from perseus.compression.dense import Dense
from perseus.compression.espresso import (Espresso, allgather_time, allreduce_time, decide, measure_codec,
                                          simulate_timeline)
from perseus.compression.topk import TopK

pytestmark = pytest.mark.timeout(120)


def random_instance(rng, n):
    """Sizes in bytes, backward seconds and cost coefficients spread over regimes where fusing sometimes
    pays and sometimes does not."""
    sizes = rng.integers(1, 1 << 20, n).astype(np.float64)
    if rng.random() < 0.2:
        sizes[rng.integers(0, n)] = 0.0
    backward = rng.uniform(0, 1e-3, n) * (rng.random(n) < 0.9)
    scale = 10.0 ** rng.uniform(-6, -3, 2)
    encode = (rng.uniform(0, 1) * scale[0], rng.uniform(0, 1e-9))
    comm = (rng.uniform(0, 1) * scale[1], rng.uniform(0, 4e-9))
    return sizes, backward, encode, comm


# -- Cupcake's planner -------------------------------------------------------------------------------------------
def test_dp_matches_brute_force_on_random_instances():
    rng = np.random.default_rng(2024)
    unique = 0
    for trial in range(240):
        n = int(rng.integers(1, 13)) if trial >= 12 else trial + 1
        sizes, backward, encode, comm = random_instance(rng, n)
        forward = float(rng.uniform(0, 1e-3))
        plan = plan_fusion(sizes, backward, encode, comm, forward)
        assert plan[0][0] == 0 and plan[-1][1] == n
        assert all(a < b for a, b in plan) and all(plan[i][1] == plan[i + 1][0] for i in range(len(plan) - 1))
        t = simulate(plan, sizes, backward, encode, comm, forward)
        best, best_plans, times = plan_fusion_brute_force(sizes, backward, encode, comm, forward)
        assert t == pytest.approx(best, rel=1e-12, abs=1e-15), (trial, plan, best_plans)
        if len(times) == 1 or times[1] - times[0] > 1e-9 * times[0]:
            unique += 1
            assert plan == best_plans[0], (trial, plan, best_plans)
    assert unique > 100  # most instances have one best plan, and the DP finds that plan


def test_ratio_is_a_factor_on_comm_beta():
    rng = np.random.default_rng(7)
    for _ in range(20):
        sizes, backward, encode, comm = random_instance(rng, 8)
        r = float(rng.uniform(0.01, 1))
        assert plan_fusion(sizes, backward, encode, comm, ratio=r) == \
            plan_fusion(sizes, backward, encode, (comm[0], comm[1] * r))
        assert simulate([(0, 8)], sizes, backward, encode, comm, ratio=r) == pytest.approx(
            simulate([(0, 8)], sizes, backward, encode, (comm[0], comm[1] * r)), rel=1e-12)


def test_degenerate_cases():
    assert plan_fusion([], []) == []
    assert plan_fusion([100.0], [1e-3], (1e-4, 1e-9), (1e-4, 1e-9)) == [(0, 1)]
    sizes = [4e6, 1e3, 2e5, 8e6, 16.0]
    backward = [1e-3, 2e-4, 5e-4, 3e-3, 1e-5]
    # huge fixed encode cost: one group
    assert plan_fusion(sizes, backward, (10.0, 1e-9), (1e-5, 1e-9)) == [(0, 5)]
    # huge fixed comm cost, no per-byte cost: one group
    assert plan_fusion(sizes, backward, (0.0, 0.0), (10.0, 0.0)) == [(0, 5)]
    # no fixed costs: sending each tensor at once is optimal (fusing only delays)
    layerwise = [(i, i + 1) for i in range(5)]
    for encode, comm in [((0.0, 1e-9), (0.0, 1e-8)), ((0.0, 0.0), (0.0, 1e-9)), ((0.0, 1e-9), (0.0, 0.0))]:
        t = simulate(plan_fusion(sizes, backward, encode, comm), sizes, backward, encode, comm)
        assert t == pytest.approx(simulate(layerwise, sizes, backward, encode, comm), rel=1e-12)
        best, _, _ = plan_fusion_brute_force(sizes, backward, encode, comm)
        assert t == pytest.approx(best, rel=1e-12)
    # all costs zero: every plan ties; the fewest groups wins
    assert plan_fusion(sizes, backward) == [(0, 5)]
    # forward time only shifts
    assert simulate([(0, 5)], sizes, backward, (1e-4, 0), (1e-4, 0), forward=2.0) == pytest.approx(
        2.0 + simulate([(0, 5)], sizes, backward, (1e-4, 0), (1e-4, 0)))


def test_bad_arguments():
    with pytest.raises(ValueError, match="backward times"):
        plan_fusion([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="non-negative"):
        plan_fusion([1.0], [1.0], encode=(-1.0, 0.0))
    with pytest.raises(ValueError, match="consecutive"):
        simulate([(0, 1), (2, 3)], [1, 1, 1], [0, 0, 0])
    with pytest.raises(ValueError, match="cover"):
        simulate([(0, 2)], [1, 1, 1], [0, 0, 0])


def test_dp_300_tensors():
    # How long planning takes is measured in benchmarks/, not asserted here.
    rng = np.random.default_rng(3)
    sizes, backward, _, _ = random_instance(rng, 300)
    plan = plan_fusion(sizes, backward, (2e-4, 1e-10), (1e-4, 1e-9))
    assert sum(b - a for a, b in plan) == 300
    assert plan == plan_fusion(sizes, backward, (2e-4, 1e-10), (1e-4, 1e-9))  # deterministic


# -- profiling and fitting -----------------------------------------------------------------------------------------
def test_fit_affine():
    assert fit_affine([1, 2, 3], [3, 5, 7]) == pytest.approx((1.0, 2.0))
    assert fit_affine([], []) == (0.0, 0.0)
    assert fit_affine([5, 5], [1, 3]) == (2.0, 0.0)
    a, b = fit_affine([1, 2, 3], [5, 3, 1])  # falling: constant
    assert (a, b) == (3.0, 0.0)
    a, b = fit_affine([10, 20, 30], [0.5, 2.0, 3.5])  # negative intercept: through the origin
    assert a == 0.0 and b > 0


def test_step_profiler_steps_order_and_gaps():
    p = StepProfiler()
    t = 0.0
    for step in range(3):
        for key, n in [("c", 10), ("b", 20), ("a", 30)]:
            assert p.arrive(key) == (key == "c")
            p.record(key, n, t, 0.001 * (step + 1), 8 * n, ((n,),))
            t += 0.001 * (step + 1) + 0.002
    assert p.step == 2
    s = p.summary(skip=1)
    assert s["order"] == ["c", "b", "a"] and s["elements"] == [10, 20, 30]
    assert s["backward"] == pytest.approx([0.0, 0.002, 0.002])
    assert s["busy"] == pytest.approx([0.002] * 3)  # the minimum over the steps used
    assert s["payload"] == [80, 160, 240] and s["shapes"] == [((10,),), ((20,),), ((30,),)]


# -- the Cupcake wrapper over a local stand-in ----------------------------------------------------------------------
class Echo(Reducer):
    """A stand-in compressor with no collective: the 'reduction' of one rank is its input; every call is
    recorded."""

    kind = "echo"

    def __init__(self):
        super().__init__(error_feedback=False)
        self.calls = []

    def reduce_async(self, key, arrays, outputs=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=None):
        self.calls.append((key, [a.size for a in arrays]))
        outs = outputs if outputs is not None else [np.empty_like(a) for a in arrays]

        def finish():
            for a, o in zip(arrays, outs):
                np.copyto(o, a * np.float32(postscale_factor))
            return list(outs)
        return Pending(finish)


def test_cupcake_explicit_plan_groups_and_partial_groups():
    inner = Echo()
    cc = Cupcake(inner, plan=[["a", "b"], ["c", "d", "e"]])
    x = {k: np.full(i + 2, float(i + 1), np.float32) for i, k in enumerate("abcde")}
    pend = {k: cc.reduce_async(k, [x[k]], None, postscale_factor=2.0) for k in "abcde"}
    assert inner.calls == [("cupcake[a..b]", [2, 3]), ("cupcake[c..e]", [4, 5, 6])]
    for k in "abcde":
        np.testing.assert_array_equal(pend[k].wait()[0], 2 * x[k])
    # an incomplete group: waiting submits what has arrived, under a name made of those keys
    inner.calls.clear()
    pa = cc.reduce_async("c", [x["c"]])
    pb = cc.reduce_async("d", [x["d"]])
    np.testing.assert_array_equal(pb.wait()[0], x["d"])
    assert len(inner.calls) == 1 and inner.calls[0][0].startswith("cupcake.partial.")
    first = inner.calls[0][0]
    np.testing.assert_array_equal(pa.wait()[0], x["c"])
    pe = cc.reduce_async("e", [x["e"]])
    pe.wait()
    assert inner.calls[1][0].startswith("cupcake.partial.") and inner.calls[1][0] != first
    # the same keys make the same name (every rank that makes the same calls agrees)
    cc.reduce_async("c", [x["c"]])
    q = cc.reduce_async("d", [x["d"]])
    q.wait()
    assert inner.calls[2][0] == first
    # a key outside the plan is reduced alone, under its own name
    np.testing.assert_array_equal(cc.reduce_async("z", [x["a"]]).wait()[0], x["a"])
    assert inner.calls[-1] == ("z", [2])


def test_cupcake_arguments():
    with pytest.raises(TypeError, match="communicating compressor"):
        Cupcake(object())
    with pytest.raises(ValueError, match="two groups"):
        Cupcake(TopK(0.1), plan=[["a"], ["a"]])
    with pytest.raises(ValueError, match="list of non-empty"):
        Cupcake(TopK(0.1), plan=[[]])
    with pytest.raises(ValueError, match="profile_steps"):
        Cupcake(TopK(0.1), profile_steps=0)
    cc = Cupcake(TopK(0.1))
    assert isinstance(cc, Reducer) and not cc.adopted and cc.plan is None
    with pytest.raises(TypeError, match="runs its own collective"):
        cc.compress(np.zeros(3))


def test_merge_residuals_concatenates_exactly():
    r = TopK(0.1)
    rng = np.random.default_rng(0)
    parts = {"a": rng.standard_normal(6).astype(np.float32), "b": None, "c": rng.standard_normal(4).astype(np.float32)}
    sizes = {"a": 6, "b": 3, "c": 4}
    for k, v in parts.items():
        st = r._state(k, sizes[k])
        st.residual = v
    merge_residuals(r, "g", ["a", "b", "c"], [6, 3, 4], [((2, 3),), ((3,),), ((4,),)])
    got = r.residual("g")
    np.testing.assert_array_equal(got, np.concatenate([parts["a"], np.zeros(3, np.float32), parts["c"]]))
    assert got.dtype == np.float32
    assert r.residual("a") is None and r.residual("c") is None
    assert math.fsum(got.tolist()) == math.fsum(parts["a"].tolist() + parts["c"].tolist())


# -- Espresso's models ---------------------------------------------------------------------------------------------
def naive_timeline(b, e, c, d, forward=0.0):
    comp = link = 0.0
    ends = []
    for i in range(len(b)):
        comp += b[i] + e[i]
        link = max(link, comp) + c[i]
        ends.append(link)
    t = comp
    for i in range(len(b)):
        t = max(t, ends[i]) + d[i]
    return forward + t


def test_simulate_timeline_matches_a_loop():
    rng = np.random.default_rng(11)
    for _ in range(200):
        n = int(rng.integers(1, 30))
        b, e, c, d = (rng.uniform(0, 1, n) * (rng.random(n) < 0.8) for _ in range(4))
        assert simulate_timeline(b, e, c, d, 0.5) == pytest.approx(naive_timeline(b, e, c, d, 0.5), rel=1e-12)
    assert simulate_timeline([], [], [], [], 1.5) == 1.5


def test_collective_cost_formulas():
    a, b = 1e-5, 1e-9
    assert allreduce_time(1000, 4, a, b) == pytest.approx(6 * a + 1.5 * 1000 * b)
    assert allgather_time(1000, 4, a, b) == pytest.approx(3 * a + 3 * 1000 * b)
    assert allreduce_time(1000, 1, a, b) == 0 and allgather_time(1000, 1, a, b) == 0
    np.testing.assert_allclose(allreduce_time(np.array([0.0, 8.0]), 2, a, b), [2 * a, 2 * a + 8 * b])


LINK = (50e-6, 8e-9)  # 50 us, 1 Gbit/s
P = 2


def options(elements):
    """Dense float32, fp16 and top-k 1% for tensors of ``elements`` entries: (encode, comm, decode), each of
    shape (3, N), with plausible CPU costs."""
    x = 4.0 * np.asarray(elements, np.float64)
    enc = np.array([2e-6 + 3e-11 * x, 3e-6 + 1e-9 * x, 50e-6 + 2e-10 * x])
    dec = np.array([0 * x, 1e-6 + 3e-10 * x, 5e-6 + 5e-11 * x])
    pay = np.array([x, x / 2, 8 + 0.02 * x])
    com = np.array([allreduce_time(pay[0], P, *LINK), allreduce_time(pay[1], P, *LINK),
                    allgather_time(pay[2], P, *LINK)])
    return enc, com, dec


def total(backward, enc, com, dec, choice):
    cols = np.arange(len(choice))
    choice = np.asarray(choice)
    return simulate_timeline(backward, enc[choice, cols], com[choice, cols], dec[choice, cols])


def test_espresso_huge_tensor_on_slow_link_is_compressed():
    elements = [16 << 20]
    enc, com, dec = options(elements)
    choice = decide(elements, [1e-3], enc, com, dec)
    assert choice.tolist() == [2]
    assert total([1e-3], enc, com, dec, choice) < 0.5 * total([1e-3], enc, com, dec, [0])


def test_espresso_tiny_tensor_is_not_compressed():
    elements = [16]
    enc, com, dec = options(elements)
    assert decide(elements, [1e-3], enc, com, dec).tolist() == [0]


def test_espresso_gain_within_min_gain_stays_dense():
    elements = [16 << 20]
    enc, com, dec = options(elements)
    gain = total([1e-3], enc, com, dec, [0]) - total([1e-3], enc, com, dec, [2])
    assert gain > 0
    assert decide(elements, [1e-3], enc, com, dec, min_gain=0.99 * gain).tolist() == [2]
    assert decide(elements, [1e-3], enc, com, dec, min_gain=1.01 * gain)[0] != 2


def test_espresso_tensor_before_a_bubble_is_not_compressed():
    """T0 (large) is ready early and its collective ends long before T1 is ready: compressing T0 cannot
    shorten the iteration (the link would only wait longer), though the same tensor last would be
    compressed."""
    elements = [1 << 20, 1 << 20]
    backward = [1e-3, 1.0]  # T1 comes a second after T0
    enc, com, dec = options(elements)
    assert com[0, 0] < 0.1  # T0's dense collective ends well before T1 is ready
    choice = decide(elements, backward, enc, com, dec)
    assert choice[0] == 0 and choice[1] != 0
    # compressing T0 would only add its encode and decode
    assert total(backward, enc, com, dec, [2, choice[1]]) > total(backward, enc, com, dec, choice)


def test_espresso_compressing_everything_can_lose():
    """Many mid-sized tensors with backward long enough to hide dense communication: compressing all of
    them adds encode time on the compute queue and makes the iteration slower than dense."""
    elements = [1 << 12] * 8
    backward = [2e-3] * 8
    enc, com, dec = options(elements)
    dense = total(backward, enc, com, dec, [0] * 8)
    assert total(backward, enc, com, dec, [2] * 8) > dense
    choice = decide(elements, backward, enc, com, dec)
    assert total(backward, enc, com, dec, choice) < dense
    assert choice.tolist() == [0] * 7 + [2]  # only the last collective is exposed


def test_espresso_greedy_near_exhaustive_and_deterministic():
    rng = np.random.default_rng(5)
    gaps = []
    for _ in range(150):
        n = int(rng.integers(1, 7))
        elements = rng.integers(1, 1000, n)
        backward = rng.uniform(0, 1, n)
        enc = rng.uniform(0, 0.5, (3, n))
        com = rng.uniform(0, 2, (3, n))
        dec = rng.uniform(0, 0.2, (3, n))
        enc[0] = dec[0] = 0
        choice = decide(elements, backward, enc, com, dec)
        assert np.array_equal(choice, decide(elements, backward, enc, com, dec))
        got = total(backward, enc, com, dec, choice)
        assert got <= total(backward, enc, com, dec, [0] * n) + 1e-12  # never worse than dense
        best = min(total(backward, enc, com, dec, list(c)) for c in itertools.product(range(3), repeat=n))
        gaps.append(got / best - 1)
    gaps = np.array(gaps)
    assert np.median(gaps) < 0.01 and gaps.max() < 0.35, (np.median(gaps), gaps.max())


def test_measure_codec_fits_and_cache():
    fits = measure_codec(TopK(0.01), 2, sizes=(1 << 10, 1 << 14), repeats=1)
    assert fits["collective"] == "allgather"
    assert fits["payload"][1] == pytest.approx(0.02, rel=0.05)  # 8 bytes per 1% of 4-byte entries
    assert all(v >= 0 for key in ("encode", "decode", "payload") for v in fits[key])
    assert measure_codec(TopK(0.01), 2, sizes=(1 << 10, 1 << 14), repeats=1) is fits
    half = measure_codec(Dense("float16"), 2, sizes=(1 << 10, 1 << 14), repeats=1)
    assert half["collective"] == "allreduce" and half["payload"] == pytest.approx((0.0, 0.5), abs=1e-9)


def test_dense_reducer_codec():
    d = Dense("float16", error_feedback=True)
    st = KeyState(5)
    acc = np.array([1.0, 1e-4, 3.3, -2.0, 70000.0], np.float32)
    orig = acc.copy()
    payload, ctx = d._encode(acc, st)
    assert payload.dtype == np.float16 and payload[-1] == 65504  # saturated, the excess kept
    np.testing.assert_array_equal(payload.astype(np.float32) + acc, orig)  # what is kept + what is sent
    assert d._decode(payload, None, ctx, st).dtype == np.float32
    full = Dense("float32")
    acc = orig.copy()
    payload, _ = full._encode(acc, KeyState(5))
    np.testing.assert_array_equal(payload, orig)
    with pytest.raises(ValueError, match="float32"):
        Dense("int8")


def test_espresso_arguments_and_policies():
    es = Espresso()
    assert es.names == ["dense", "fp16", "topk(0.01)"] and isinstance(es, Reducer)
    es2 = Espresso(candidates=[TopK(0.001), "fp16"])
    assert es2.names == ["dense", "topk(0.001)", "fp16"]
    with pytest.raises(ValueError, match="unknown candidate"):
        Espresso(candidates=["bogus"])
    with pytest.raises(ValueError, match="one of"):
        es.set_policy("fast")
    es.set_policy("dense")
    assert es.policy == "dense" and es.option_of("x") == 0
    assert es.report() == [] and "no decision" in es.format_report()


def test_cupcake_rejects_what_the_compressors_reject():
    cc = Cupcake(Echo(), plan=[["a", "b"]])
    with pytest.raises(ValueError, match="floating-point"):
        cc.reduce_async("a", [np.zeros(3, np.int32)])
    with pytest.raises(ValueError, match="Sum or Average"):
        cc.reduce_async("a", [np.zeros(3, np.float32)], op=3)
    with pytest.raises(ValueError, match="needs a name"):
        cc.reduce_async("", [np.zeros(3, np.float32)])
