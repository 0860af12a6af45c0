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
