"""Cupcake's planner: the timeline model of fused gradients and the partition with the least iteration time.

:func:`plan_fusion` picks the partition of gradients into consecutive groups that minimises the modelled
iteration time:

* gradients ``0..N-1`` in backward order (0 ready first), ``sizes[i]`` bytes, ``backward_times[i]`` the
  seconds of backward between gradient ``i-1`` becoming ready and gradient ``i`` becoming ready;
* backward and encoding share one compute resource (serialised): a group is encoded right after its last
  gradient is computed, and backward resumes only afterwards (the encode runs in the gradient hook);
* one communication channel, first in first out: a group's collective starts when its encode has ended
  and the previous group's collective has finished;
* ``h(x) = alpha_h + beta_h * x`` seconds to encode a group of ``x`` bytes and ``g(x) = alpha_g +
  beta_g * ratio * x`` seconds to communicate it. Both take ``x`` = the group's *dense* (input) bytes; the
  encoded size enters through ``ratio`` (encoded bytes per dense byte) or a ``beta_g`` already expressed
  per dense byte (the default ``ratio=1.0``). A payload with a constant part (``p0 + r * x`` bytes)
  folds into ``alpha_g += beta_g * p0``, ``beta_g *= r``;
* iteration time = ``forward`` + the end of the last collective (decoding is not modelled).

Under this model the compute end after the first ``j`` gradients in ``m`` groups depends only on ``(j, m)``
and every later collective's end is non-decreasing in the current channel end, so the dynamic programme
``D[j][m] = min_k max(D[k][m-1], C(j, m)) + g(k..j-1)`` is exact: ``O(N^3)`` time, vectorised over
``(k, j)`` with NumPy (300 gradients plan in a few tens of milliseconds). :func:`plan_fusion_brute_force`
enumerates all ``2**(N-1)`` partitions; it exists for tests. :func:`simulate` gives one plan's modelled time.

Local: no collective (:class:`~perseus.compression.cupcake.Cupcake` plans on one rank and broadcasts).
The functions raise ValueError for sizes and backward times of different lengths, negative sizes, times,
cost coefficients or ratio; :func:`simulate` also for groups that are not consecutive and covering.
"""

from __future__ import annotations

import itertools

import numpy as np

__all__ = ["plan_fusion", "simulate", "plan_fusion_brute_force"]


def _model(sizes, backward_times, encode, comm, ratio):
    s = np.asarray(sizes, np.float64).reshape(-1)
    b = np.asarray(backward_times, np.float64).reshape(-1)
    if s.shape != b.shape:
        raise ValueError(f"perseus: plan_fusion: {s.size} sizes but {b.size} backward times")
    if (s < 0).any() or (b < 0).any():
        raise ValueError("perseus: plan_fusion: sizes and backward times must be non-negative")
    ah, bh = (float(v) for v in encode)
    ag, bg = (float(v) for v in comm)
    if min(ah, bh, ag, bg, float(ratio)) < 0:
        raise ValueError("perseus: plan_fusion: the cost coefficients and the ratio must be non-negative")
    return s, b, ah, bh, ag, bg * float(ratio)


def simulate(groups, sizes, backward_times, encode=(0.0, 0.0), comm=(0.0, 0.0), forward: float = 0.0,
             ratio: float = 1.0) -> float:
    """The modelled iteration time (seconds) of ``groups``: half-open ``(start, end)`` index ranges that
    cover ``0..N-1`` in order (see the module docstring for the model)."""
    s, b, ah, bh, ag, bg = _model(sizes, backward_times, encode, comm, ratio)
    expect = 0
    comp_end = comm_end = 0.0
    for start, end in groups:
        if start != expect or end <= start:
            raise ValueError(f"perseus: simulate: groups must be consecutive, non-empty and start at 0; "
                             f"got {list(groups)}")
        expect = end
        x = float(s[start:end].sum())
        comp_end += float(b[start:end].sum()) + ah + bh * x
        comm_end = max(comp_end, comm_end) + ag + bg * x
    if expect != s.size:
        raise ValueError(f"perseus: simulate: the groups cover {expect} of {s.size} tensors")
    return float(forward) + comm_end


def plan_fusion(sizes, backward_times, encode=(0.0, 0.0), comm=(0.0, 0.0), forward: float = 0.0,
                ratio: float = 1.0) -> list:
    """The partition of tensors ``0..N-1`` (backward order) into consecutive groups with the least modelled
    iteration time: a list of half-open ``(start, end)`` index ranges.

    Args:
        sizes: bytes of each tensor (dense).
        backward_times: seconds of backward before each tensor is ready (after the previous one).
        encode: ``(alpha_h, beta_h)``: seconds per encode call and per dense byte.
        comm: ``(alpha_g, beta_g)``: seconds per collective and per byte sent.
        forward: seconds of forward pass (a constant added to every plan's time).
        ratio: bytes sent per dense byte (1.0: ``beta_g`` is already per dense byte).

    Ties go to the plan found first: fewest groups, then the largest last group. Deterministic.
    """
    s, b, ah, bh, ag, bg = _model(sizes, backward_times, encode, comm, ratio)
    n = s.size
    if n == 0:
        return []
    P = np.concatenate([[0.0], np.cumsum(s)])
    PB = np.concatenate([[0.0], np.cumsum(b)])
    inf = np.inf
    prev = np.full(n + 1, inf)
    prev[0] = 0.0
    parent = np.zeros((n + 1, n + 1), np.int64)  # parent[m, j]: end of the previous group
    best_t, best_m = inf, 0
    for m in range(1, n + 1):
        j = np.arange(m, n + 1)           # the m-th group ends before tensor j
        k = np.arange(m - 1, n)           # ... and starts at tensor k
        comp = PB[j] + m * ah + bh * P[j]
        cost = np.maximum(prev[k][:, None], comp[None, :]) + (ag + bg * (P[j][None, :] - P[k][:, None]))
        cost[k[:, None] >= j[None, :]] = inf
        arg = np.argmin(cost, axis=0)
        cur = np.full(n + 1, inf)
        cur[j] = cost[arg, np.arange(j.size)]
        parent[m, j] = k[arg]
        if cur[n] < best_t:
            best_t, best_m = cur[n], m
        prev = cur
    groups, end = [], n
    for m in range(best_m, 0, -1):
        start = int(parent[m, end])
        groups.append((start, end))
        end = start
    groups.reverse()
    return groups


def plan_fusion_brute_force(sizes, backward_times, encode=(0.0, 0.0), comm=(0.0, 0.0), forward: float = 0.0,
                            ratio: float = 1.0):
    """Every partition evaluated with :func:`simulate` (``2**(N-1)`` of them; for tests, N up to ~16).

    Returns ``(best time, [every plan reaching it within 1e-12 relative], sorted times of all plans)``.
    """
    n = len(sizes)
    if n == 0:
        return float(forward), [[]], [float(forward)]
    results = []
    for cuts in itertools.product((False, True), repeat=n - 1):
        groups, start = [], 0
        for i, cut in enumerate(cuts, 1):
            if cut:
                groups.append((start, i))
                start = i
        groups.append((start, n))
        results.append((simulate(groups, sizes, backward_times, encode, comm, forward, ratio), groups))
    best = min(t for t, _ in results)
    tol = 1e-12 * max(1.0, abs(best))
    return best, [g for t, g in results if t <= best + tol], sorted(t for t, _ in results)
