"""benchmarks/scaling_model.py: the fit recovers known parameters, the model's shape, and docs/scaling.md holds
the block the committed results give."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import scaling_model as sm  # noqa: E402


def synthetic(eta: float, c: float) -> dict:
    """Steps the model itself would give on an 800/200 Mbit/s cluster for the given parameters."""
    p = {"eta": eta, "c_s_per_byte": c}
    return {(f"perseus-{ch}ch", "resnet50", 2): (sm.emulated_step(f"perseus-{ch}ch", "resnet50", 2, 800, 200, ch, p),
                                                 800.0, 200.0, ch) for ch in (1, 2, 4, 8)}


def test_the_fit_recovers_the_parameters_that_made_the_steps():
    p = sm.fit(synthetic(0.9, 2e-9))
    assert p["eta"] == pytest.approx(0.9) and p["c_s_per_byte"] == pytest.approx(2e-9)


def test_a_ring_across_more_hosts_moves_more_bytes_and_a_faster_link_fewer_seconds():
    assert sm.wire_s(1e8, 1, 1e9, 1e9, 1, 1.0) == 0.0
    assert sm.wire_s(1e8, 2, 1e9, 1e9, 1, 1.0) == pytest.approx(0.8)  # S bytes over one 1 Gbit/s flow
    assert sm.wire_s(1e8, 4, 1e9, 1e9, 1, 1.0) == pytest.approx(1.2)
    assert sm.wire_s(1e8, 2, 1e9, 0.25e9, 2, 1.0) == pytest.approx(1.6)  # two flows of a quarter each
    p = {"eta": 1.0, "c_s_per_byte": 0.0, "t_tensor_s": 0.0}
    slow, fast = (sm.project("resnet50", 64, link, p, sm.ASSUMED) for link in (25, 400))
    assert slow["comm_ms"] > fast["comm_ms"] and slow["efficiency"] < fast["efficiency"] <= 1.0
    assert sm.project("resnet50", 8, 25, p, sm.ASSUMED)["comm_ms"] < slow["comm_ms"]  # one node: no network


def test_docs_scaling_holds_the_block_of_the_committed_results():
    with open(os.path.join(ROOT, "docs", "scaling.md")) as f:
        doc = f.read()
    assert sm.report() in doc, "docs/scaling.md is stale: run python benchmarks/scaling_model.py --write docs/scaling.md"
