"""The autotuner's search without a job: the bandit's credit and choice, every technique, and the search
loop on made-up cost functions (deterministic: seeded techniques, noise from a seeded generator)."""

from __future__ import annotations

import math
import random

import pytest

pytest.importorskip("optuna")

from perseus.autotune.bandit import AucBandit  # noqa: E402
from perseus.autotune.search import Search  # noqa: E402
from perseus.autotune.space import Config, Space  # noqa: E402
from perseus.autotune.techniques import Bayesian, GridSearch, Hyperband, PopulationBased  # noqa: E402

pytestmark = pytest.mark.timeout(120)
MB = 1 << 20


def space(**fixed):
    return Space.build(max_channels=8, multi_host=True, fixed=fixed)


def cost_fn(c: Config, rng=None) -> float:
    """A bowl with its minimum at 8 MB units, 4 channels, ring, no cycle time, 256 KB in-place."""
    cost = (abs(math.log2(c.fusion_threshold_bytes / (8 * MB))) * 0.2 + abs(math.log2(c.channels / 4)) * 0.5
            + (0.0 if c.algorithm == 2 else 0.3) + c.cycle_time_us * 1e-4
            + abs(math.log2(c.inplace_threshold_bytes / (256 << 10))) * 0.05 + 1.0)
    return cost * (1 + rng.gauss(0, 0.02)) if rng else cost


def test_bandit_credit_is_the_normalised_area_under_the_improvement_curve():
    b = AucBandit(["a", "b"], c=0.2, window=10)
    for improved in (True, False, True):
        b.record("a", improved)
    b.record("b", False)
    # a: heights 1, 1, 2 -> area 4 of at most 1+2+3 = 6
    assert b.credit("a") == pytest.approx(4 / 6)
    assert b.credit("b") == 0.0
    assert b.select() == "a"
    for _ in range(10):  # the window forgets: only b's flat uses remain
        b.record("b", False)
    assert b.uses("a") == 0 and b.select() == "a"  # an arm unused in the window comes first


def test_bandit_explores_an_arm_used_rarely():
    b = AucBandit(["a", "b"], c=5.0, window=100)
    b.record("b", False)
    for _ in range(20):
        b.record("a", False)
    assert b.select() == "b"


def test_space_respects_fixed_values_and_neighbours():
    s = space(channels=2)
    assert s.choices("channels") == (2,)
    assert all(p.channels == 2 for p in s.grid()[:50])
    base = Config(4 * MB, 256 << 10, 2, 0, 2)
    for n in s.neighbours(base):
        assert sum(a != b for a, b in zip(n.values(), base.values())) == 1
    assert s.nearest(Config(5 * MB, 1, 3, 7, 2)) == Config(4 * MB, 64 << 10, 2, 0, 2)
    with pytest.raises(ValueError, match="unknown tuned parameter"):
        space(nope=1)


@pytest.mark.parametrize("technique", [GridSearch, Bayesian, Hyperband, PopulationBased])
def test_each_technique_proposes_points_of_the_space_and_improves(technique):
    s = space()
    t = technique(s, seed=3)
    costs, configs = [], []
    for _ in range(30):
        c = t.ask()
        assert s.contains(c)
        cost = cost_fn(c)
        t.tell(c, cost, own=True)
        costs.append(cost)
        configs.append(c)
    if technique is GridSearch:
        assert len(set(configs)) == 30  # no point twice
    elif technique is Hyperband:
        counts = [configs.count(c) for c in set(configs)]
        assert max(counts) == 3 and min(counts) == 1  # good ones get every sample, poor ones are pruned
    else:
        assert min(costs[15:]) <= min(costs[:5])  # it learns


def test_search_finds_a_near_optimal_setting_from_a_bad_start():
    rng = random.Random(0)
    s = space()
    search = Search(s, seed=1, start=Config(256 << 10, 4 * MB, 1, 1000, 1))
    used = set()
    for _ in range(40):
        name, config = search.next()
        used.add(name)
        search.observe(name, config, cost_fn(config, rng))
    best, _ = search.best()
    assert cost_fn(best) <= 1.15 * 1.0  # the optimum costs 1.0
    assert used >= {"start", "grid", "bayesian", "hyperband", "pbt"}
    assert search.finalists(2)[0] == best


def test_log_and_report(tmp_path):
    from perseus.autotune.log import COLUMNS, TuneLog
    from perseus.autotune.report import main as report, read_log

    log_path = tmp_path / "tune.csv"
    log = TuneLog(str(log_path))
    for i, (tech, cost) in enumerate([("start", 0.03), ("grid", 0.02), ("bayesian", 0.025)], 1):
        log.row(sample=i, step=4 * i, technique=tech, config=Config(4 * MB, 256 << 10, 2, 0, 2), cost=cost,
                best_cost=min(0.03, cost), steps=[(cost, 1000, 0)])
    log.close()
    rows = read_log(str(log_path))
    assert list(rows[0]) == list(COLUMNS) and len(rows) == 3 and rows[1]["technique"] == "grid"
    pytest.importorskip("matplotlib")
    out = tmp_path / "tune.png"
    assert report([str(log_path), "-o", str(out)]) == 0
    assert out.stat().st_size > 1000
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    assert report([str(bad), "-o", str(out)]) == 2


def test_cache_exact_and_similar_jobs(tmp_path):
    from perseus.autotune import cache

    f = str(tmp_path / "sub" / "autotune.json")
    assert cache.lookup(f, 1, (2, 1, 2), 100 * MB) is None  # nothing stored yet (no file)
    a = Config(4 * MB, 256 << 10, 8, 0, 2)
    cache.store(f, 0xABC, (2, 1, 2), 100 * MB, a, 1.1)
    assert cache.lookup(f, 0xABC, (2, 1, 2), 100 * MB) == cache.Known(a, True)
    # Another model on the same topology moving a similar number of bytes starts from a's setting...
    assert cache.lookup(f, 0xDEF, (2, 1, 2), 150 * MB) == cache.Known(a, False)
    # ...but not one that moves 3x as much, nor the same model on another topology.
    assert cache.lookup(f, 0xDEF, (2, 1, 2), 300 * MB) is None
    assert cache.lookup(f, 0xABC, (4, 2, 2), 100 * MB) is None
    with open(f, "w") as damaged:
        damaged.write("{not json")
    assert cache.lookup(f, 0xABC, (2, 1, 2), 100 * MB) is None  # a damaged file is ignored, then rewritten
    cache.store(f, 0xABC, (2, 1, 2), 100 * MB, a, 1.0)
    assert cache.lookup(f, 0xABC, (2, 1, 2), 100 * MB).exact


# -- the compressor policy dimension ---------------------------------------------------------------------------
def policy_cost(c: Config) -> float:
    """cost_fn, and the 'dense' policy (1) is best by far."""
    return cost_fn(c) + (0.0 if c.compression_policy == 1 else 0.5)


def test_policy_dimension_only_when_asked():
    from perseus.autotune.space import ALL_PARAMS, COMPRESSION_POLICIES, PARAMS, POLICY
    from perseus.compression.espresso import POLICIES

    assert COMPRESSION_POLICIES == POLICIES  # Config.compression_policy indexes Espresso's policies
    plain, with_policy = space(), Space.build(max_channels=8, multi_host=True, policies=True)
    assert plain.searched() == PARAMS and plain.choices(POLICY) == (0,)
    assert with_policy.searched() == PARAMS + (POLICY,) and with_policy.choices(POLICY) == (0, 1, 2)
    assert with_policy.size() == 3 * plain.size()
    assert {c.compression_policy for c in plain.grid()} == {0}
    assert {c.compression_policy for c in with_policy.grid()} == {0, 1, 2}
    assert len(set(with_policy.grid())) == with_policy.size()
    c = Config(4 * MB, 256 << 10, 2, 0, 2)  # five fields: the policy defaults to 'espresso'
    assert c.compression_policy == 0 and c.policy_name == "espresso"
    assert plain.contains(c) and with_policy.contains(c)
    d = Config(4 * MB, 256 << 10, 2, 0, 2, 1)
    assert not plain.contains(d) and with_policy.contains(d) and plain.nearest(d) == c
    assert d.values() == c.values() == (4 * MB, 256 << 10, 2, 0, 2)  # what a TUNE request carries
    assert d.all_values() == c.values() + (1, 0, 0, 0, 0)
    assert "policy" not in d.describe() and d.describe(policy=True).endswith(", policy dense")
    assert {n.compression_policy for n in with_policy.neighbours(d)} == {0, 1, 2}
    assert {n.compression_policy for n in plain.neighbours(c)} == {0}
    fixed = Space.build(max_channels=8, multi_host=True, policies=True, fixed={POLICY: 2})
    assert fixed.searched() == PARAMS and {p.compression_policy for p in fixed.grid()[:20]} == {2}
    assert with_policy.with_policies((1,)).choices(POLICY) == (1,)


@pytest.mark.parametrize("technique", [GridSearch, Bayesian, Hyperband, PopulationBased])
def test_each_technique_searches_the_policy(technique):
    s = Space.build(max_channels=8, multi_host=True, policies=True)
    t = technique(s, seed=5)
    seen = set()
    for _ in range(40):
        c = t.ask()
        assert s.contains(c)
        seen.add(c.compression_policy)
        t.tell(c, policy_cost(c), own=True)
    assert len(seen) >= 2, seen
    # Samples proposed by another technique are learnt too (Optuna: as trials over the same dimensions).
    other = Config(8 * MB, 256 << 10, 4, 0, 2, 1)
    t.tell(other, policy_cost(other), own=False)


def test_search_finds_the_best_policy():
    rng = random.Random(0)
    s = Space.build(max_channels=8, multi_host=True, policies=True)
    search = Search(s, seed=1, start=Config(256 << 10, 4 * MB, 1, 1000, 1, 0))
    for _ in range(40):
        name, config = search.next()
        search.observe(name, config, policy_cost(config) * (1 + rng.gauss(0, 0.02)))
    assert search.best()[0].compression_policy == 1


def test_cache_keeps_the_policy_and_loads_entries_without_it(tmp_path):
    import json

    from perseus.autotune import cache

    f = str(tmp_path / "autotune.json")
    dense = Config(4 * MB, 256 << 10, 8, 0, 2, 1)
    cache.store(f, 0xABC, (2, 1, 2), 100 * MB, dense, 1.0)
    assert cache.lookup(f, 0xABC, (2, 1, 2), 100 * MB) == cache.Known(dense, True)
    # An entry written before the policy existed (five fields) loads with the default policy, 'espresso'.
    with open(f) as fh:
        data = json.load(fh)
    entry = next(iter(data.values()))
    del entry["config"]["compression_policy"]
    with open(f, "w") as fh:
        json.dump(data, fh)
    old = cache.lookup(f, 0xABC, (2, 1, 2), 100 * MB)
    assert old.exact and old.config == Config(4 * MB, 256 << 10, 8, 0, 2) and old.config.policy_name == "espresso"


def test_log_has_a_policy_column(tmp_path):
    from perseus.autotune.log import COLUMNS, TuneLog
    from perseus.autotune.report import read_log

    path = tmp_path / "tune.csv"
    log = TuneLog(str(path))
    log.row(sample=1, step=3, technique="grid", config=Config(4 * MB, 256 << 10, 2, 0, 2, 2), cost=0.01,
            best_cost=0.01, steps=[(0.01, 1000, 0)], policy=True)
    log.row(sample=2, step=6, technique="grid", config=Config(4 * MB, 256 << 10, 2, 0, 2), cost=0.01,
            best_cost=0.01, steps=[(0.01, 1000, 0)])
    log.close()
    rows = read_log(str(path))
    assert COLUMNS[-5:] == ("compression_policy", "sparse_algorithm", "dear_threshold_bytes", "device_bucket_bytes",
                            "device_path")
    assert [r["compression_policy"] for r in rows] == ["all-compressed", ""]
    assert [r["sparse_algorithm"] for r in rows] == ["", ""]


def test_sparse_dimension_only_when_asked():
    from perseus.autotune.space import ALL_PARAMS, PARAMS, POLICY, SPARSE, SPARSE_ALGORITHMS
    from perseus.sparse.choice import ALGORITHMS

    assert SPARSE_ALGORITHMS[0] == "auto" and sorted(SPARSE_ALGORITHMS[1:]) == sorted(ALGORITHMS)
    plain = space()
    sparse = plain.with_sparse(range(len(SPARSE_ALGORITHMS)))
    assert plain.searched() == PARAMS and sparse.searched() == PARAMS + (SPARSE,)
    both = sparse.with_policies((0, 1, 2))
    assert both.searched() == PARAMS + (POLICY, SPARSE)
    every = both.with_choices("dear_threshold", (0, 1)).with_choices("device_bucket", (0, 2))
    assert every.with_choices("device_path", (0, 1)).searched() == ALL_PARAMS == PARAMS + (
        POLICY, SPARSE, "dear_threshold", "device_path", "device_bucket")
    assert sparse.size() == len(SPARSE_ALGORITHMS) * plain.size()
    assert {c.sparse_algorithm for c in sparse.grid()} == set(range(len(SPARSE_ALGORITHMS)))
    c = Config(4 * MB, 256 << 10, 2, 0, 2, 0, 3)
    assert c.sparse_name == "zen" and c.all_values()[-4:] == (3, 0, 0, 0)
    assert c.describe(sparse=True).endswith(", sparse zen") and "sparse" not in c.describe()
    assert not plain.contains(c) and sparse.contains(c) and plain.nearest(c).sparse_algorithm == 0
    assert {n.sparse_algorithm for n in sparse.neighbours(c)} == {2, 3, 4}
    assert sparse.with_sparse((3,)).searched() == PARAMS


def test_fixed_params_may_name_the_policy():
    from perseus.autotune.tuner import tuned_fixed_params
    from perseus.base.knobs import load_settings

    fixed = tuned_fixed_params(load_settings({"PERSEUS_AUTOTUNE_FIXED": "channels,compression_policy"}))
    assert sorted(fixed) == ["channels", "compression_policy"] and fixed["compression_policy"] == -1
    fixed = tuned_fixed_params(load_settings({"PERSEUS_AUTOTUNE_FIXED": "sparse_algorithm"}))
    assert fixed == {"sparse_algorithm": -1}
    assert "compression_policy" not in tuned_fixed_params(load_settings({"PERSEUS_AUTOTUNE_FIXED": "explicit"}))
    assert tuned_fixed_params(load_settings({"PERSEUS_AUTOTUNE_FIXED": "none"})) == {}
    with pytest.raises(ValueError, match="compression_policy"):  # the message lists it among the names
        tuned_fixed_params(load_settings({"PERSEUS_AUTOTUNE_FIXED": "nope"}))


# -- the per-step agreement on the policy, without a job (the all-reduce replaced) ---------------------------
class _Compressor:
    pass


class _Ranks:
    """Stands in for the per-step all-reduce: returns the maximum this test says the other ranks have."""

    def __init__(self, monkeypatch):
        self.others = (0, False)
        self.calls = []
        import perseus.runtime.step_policy as policy

        def fake_max(name, process_set, posted, ended):
            assert name.startswith("perseus.autotune.policy.")
            self.calls.append(int(name.rsplit(".", 1)[1]))
            return max(posted, self.others[0]), bool(ended or self.others[1])
        monkeypatch.setattr(policy, "_max", fake_max)


def test_follower_applies_a_proposal_at_a_step_boundary_only(monkeypatch):
    import threading

    from perseus.runtime.step_policy import PolicyLink

    ranks = _Ranks(monkeypatch)
    link = PolicyLink()
    owner, other = _Compressor(), _Compressor()
    f = link.register(owner)
    assert link.register(owner) is f and link.register(other) is None and link.registered() is owner
    assert f.at_call("a", None) is None and ranks.calls == [0]  # step 0 begins: one all-reduce, nothing new
    assert f.at_call("b", None) is None and ranks.calls == [0]  # not a boundary: nothing runs
    link.post(1)
    assert f.at_call("c", None) is None  # still step 0: the policy waits for the boundary
    assert f.at_call("a", None) == 1 and ranks.calls == [0, 1] and f.applied == 1 and f.waits == 0
    # Another rank's tuner has heard of setting 2 already: this rank waits for its own tuner.
    ranks.others = (2, False)
    threading.Timer(0.2, link.post, args=(2,)).start()
    assert f.at_call("a", None) == 2 and f.applied == 2 and f.waits == 1
    link.post(-1)  # -1: the tuner leaves the policy alone
    assert f.at_call("a", None) is None and f.applied == 3
    link.post(0, done=True)
    link.post(2)  # nothing is posted after the final proposal
    assert link.posted == 4
    assert f.at_call("a", None) == 0 and f.finished
    n = len(ranks.calls)
    assert f.at_call("a", None) is None and f.at_call("a", None) is None and len(ranks.calls) == n


def test_follower_stops_when_a_tuner_ended_and_fails_clearly_when_one_never_hears(monkeypatch):
    from perseus.runtime import step_policy as policy
    from perseus.runtime.step_policy import PolicyLink
    from perseus.base.exceptions import PerseusInternalError

    ranks = _Ranks(monkeypatch)
    link = PolicyLink()
    f = link.register(_Compressor())
    ranks.others = (0, True)  # another rank's tuner thread ended without a final setting
    assert f.at_call("a", None) is None and f.finished
    link = PolicyLink()
    f = link.register(_Compressor())
    link.post(1, done=True)
    link.end()  # ended after its final proposal: the compressor applies the final one as usual
    ranks.others = (0, False)
    assert link.state() == (1, False) and f.at_call("a", None) == 1 and f.finished
    # Another rank applies setting 1, and this rank's tuner never hears of it: a clear error, not a hang.
    link = PolicyLink()
    f = link.register(_Compressor())
    ranks.others = (1, False)
    monkeypatch.setattr(policy, "WAIT_S", 0.1)
    with pytest.raises(PerseusInternalError, match="has received only 0 after 0.1 s"):
        f.at_call("a", None)
