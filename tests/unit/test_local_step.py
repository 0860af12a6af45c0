"""perseus/compression/local_step.py: momentum correction's arithmetic, masking, clipping, the warm-up
schedule and the argument checks (no MPI: the functions are local)."""

import math

import numpy as np
import pytest

from perseus.compression.base import KeyState
from perseus.compression.local_step import (LocalStep, apply_local_step, check_warmup, density_at, mask_sent,
                                            optional_spec)


def steps(spec, grads):
    """Residuals after feeding ``grads`` through apply_local_step (nothing sent)."""
    st, residual = KeyState(len(grads[0])), np.zeros(len(grads[0]), np.float32)
    for g in grads:
        apply_local_step(st, np.array(g, np.float32), residual, spec)
    return st, residual


def test_velocity_follows_torch_sgd():
    g1, g2 = [1.0, -2.0], [3.0, 0.5]
    st, res = steps(LocalStep(0.9), [g1, g2])
    u2 = 0.9 * np.array(g1) + np.array(g2)  # the first step's velocity is the gradient itself
    np.testing.assert_allclose(st.extra["velocity"], u2, rtol=1e-6)
    np.testing.assert_allclose(res, np.array(g1) + u2, rtol=1e-6)  # the velocity is accumulated


def test_nesterov_and_dampening():
    g1, g2 = np.array([1.0, -2.0]), np.array([3.0, 0.5])
    _, res = steps(LocalStep(0.9, nesterov=True), [g1, g2])
    u1, u2 = g1, 0.9 * g1 + g2
    np.testing.assert_allclose(res, (g1 + 0.9 * u1) + (g2 + 0.9 * u2), rtol=1e-6)
    st, _ = steps(LocalStep(0.9, dampening=0.5), [g1, g2])
    np.testing.assert_allclose(st.extra["velocity"], 0.9 * g1 + 0.5 * g2, rtol=1e-6)


def test_masking_zeroes_the_velocity_of_sent_entries_only_when_asked():
    st, _ = steps(LocalStep(0.9), [[1.0, 2.0, 3.0]])
    mask_sent(st, np.array([1]))
    np.testing.assert_array_equal(st.extra["velocity"], [1.0, 0.0, 3.0])
    st, _ = steps(LocalStep(0.9, masking=False), [[1.0, 2.0, 3.0]])
    mask_sent(st, np.array([1]))
    np.testing.assert_array_equal(st.extra["velocity"], [1.0, 2.0, 3.0])


def test_local_clipping_bounds_the_norm_per_entry():
    _, res = steps(LocalStep(0.0, clip_rms=0.5), [[3.0, 4.0, 0.0, 0.0]])  # norm 5 > 0.5 * sqrt(4) = 1
    assert float(np.linalg.norm(res)) == pytest.approx(1.0, rel=1e-6)
    np.testing.assert_allclose(res, [0.6, 0.8, 0.0, 0.0], rtol=1e-6)
    _, res = steps(LocalStep(0.0, clip_rms=10.0), [[3.0, 4.0, 0.0, 0.0]])  # within the bound: untouched
    np.testing.assert_array_equal(res, [3.0, 4.0, 0.0, 0.0])


def test_warmup_schedule():
    assert density_at(0.001, 0, 100, 0.25) == 0.25
    assert density_at(0.001, 50, 100, 0.25) == pytest.approx(math.sqrt(0.25 * 0.001))
    assert density_at(0.001, 100, 100, 0.25) == 0.001
    assert density_at(0.001, 7, 0, 0.25) == 0.001
    assert density_at(0.5, 0, 100, 0.25) == 0.5  # a start below the target: no warm-up
    assert check_warmup(10, 1.0, "x") == (10, 1.0)
    for bad in ((-1, 0.25), (1.5, 0.25), (True, 0.25), (10, 0.0), (10, 1.5)):
        with pytest.raises(ValueError):
            check_warmup(*bad, "Compression.topk")


def test_optional_spec():
    assert optional_spec(None) is None and optional_spec(LocalStep(0.0)) is None
    assert optional_spec(LocalStep(0.9)) == LocalStep(0.9)
    assert optional_spec(LocalStep(0.0, clip_rms=1.0)) == LocalStep(0.0, clip_rms=1.0)
    with pytest.raises(ValueError, match="momentum"):
        optional_spec(LocalStep(1.0))
    with pytest.raises(ValueError, match="bound"):
        optional_spec(LocalStep(0.9, clip_rms=-1.0))
