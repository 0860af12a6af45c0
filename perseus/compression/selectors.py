"""Top-k selection by magnitude: several algorithms, and the fastest one per size measured on this machine.

* ``exact``: NumPy's introselect (``argpartition``) on the magnitudes.
* ``torch``: ``torch.topk`` on a zero-copy view (when PyTorch is installed).
* ``mstopk``: threshold bisection (MSTopK): a few counting passes narrow a threshold so that about k
  magnitudes lie above it, then the band at the threshold fills the selection up to exactly k. Approximate:
  which band elements complete the set is arbitrary.
* ``dgc``: sampling (as in Deep Gradient Compression): the k-th largest magnitude of a random 1% sample
  estimates the threshold; every element above it is a candidate and an exact selection among the
  candidates gives the true top-k. When the estimate is too high (fewer than k candidates) the threshold is
  lowered and tried again, so the result is always the exact top-k.

Every selector returns exactly ``k`` int64 indices (unordered). :func:`select` picks the selector per size
bucket (powers of two) by timing each on the first call for that bucket; ``PERSEUS_TOPK_SELECTOR`` names
one instead.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

import numpy as np

__all__ = ["SELECTORS", "select", "choice", "chosen"]


def _exact(mag: np.ndarray, k: int) -> np.ndarray:
    n = mag.size
    if k >= n:
        return np.arange(n)
    return np.argpartition(mag, n - k)[n - k:]


def _torch(mag: np.ndarray, k: int) -> np.ndarray:
    import torch

    if k >= mag.size:
        return np.arange(mag.size)
    return torch.topk(torch.from_numpy(mag), k, sorted=False).indices.numpy()


def _mstopk(mag: np.ndarray, k: int, rounds: int = 20) -> np.ndarray:
    n = mag.size
    if k >= n:
        return np.arange(n)
    lo, hi = 0.0, float(mag.max())
    if hi == 0.0:
        return np.arange(k)
    for _ in range(rounds):
        mid = 0.5 * (lo + hi)
        count = int(np.count_nonzero(mag >= mid))
        if count == k:
            return np.flatnonzero(mag >= mid)
        if count > k:
            lo = mid
        else:
            hi = mid
    # fewer than k magnitudes reach hi (or ties at the maximum): fill from the band [lo, hi)
    top = np.flatnonzero(mag >= hi)[:k]
    band = np.flatnonzero((mag >= lo) & (mag < hi))
    return np.concatenate([top, band[:k - top.size]])


def _dgc(mag: np.ndarray, k: int, rng=np.random.default_rng(12345)) -> np.ndarray:
    n = mag.size
    if k >= n:
        return np.arange(n)
    samples = min(n, max(1024, n // 100))
    sample = mag[rng.integers(0, n, samples)]
    ks = max(1, int(round(samples * k / n)))
    thr = float(np.partition(sample, samples - ks)[samples - ks])
    for _ in range(8):
        cand = np.flatnonzero(mag >= thr)
        if cand.size >= k:
            if cand.size == k:
                return cand
            sub = mag[cand]
            return cand[np.argpartition(sub, cand.size - k)[cand.size - k:]]
        thr *= 0.5
    return _exact(mag, k)


SELECTORS: dict[str, Callable[[np.ndarray, int], np.ndarray]] = {
    "exact": _exact, "mstopk": _mstopk, "dgc": _dgc,
}
try:  # noqa: SIM105 - optional
    import torch  # noqa: F401 - only to know whether it is there

    SELECTORS["torch"] = _torch
except ImportError:  # pragma: no cover - torch-less installs
    pass

_lock = threading.Lock()
_fastest: dict[int, str] = {}


def _bucket(n: int) -> int:
    return max(10, int(n - 1).bit_length())


def _measure(n: int, density: float) -> str:
    """Time every selector on random data of ``n`` elements; the fastest one's name."""
    rng = np.random.default_rng(n)
    mag = np.abs(rng.standard_normal(n).astype(np.float32))
    k = max(1, int(np.ceil(density * n)))
    best, best_t = "exact", float("inf")
    for name, fn in SELECTORS.items():
        fn(mag, k)  # warm
        t0 = time.perf_counter()
        for _ in range(2):
            fn(mag, k)
        t = time.perf_counter() - t0
        if t < best_t:
            best, best_t = name, t
    return best


def choice(n: int, density: float, forced: Optional[str] = None) -> str:
    """The selector used for ``n`` elements: ``forced`` (a name, or 'auto'), else the fastest measured."""
    if forced and forced != "auto":
        if forced not in SELECTORS:
            raise ValueError(f"perseus: unknown top-k selector {forced!r}; choose one of "
                             f"{', '.join(['auto', *SELECTORS])}")
        return forced
    b = _bucket(n)
    with _lock:
        name = _fastest.get(b)
    if name is None:
        name = _measure(1 << b if b < 26 else n, density) if n >= 4096 else "exact"
        with _lock:
            _fastest.setdefault(b, name)
    return name


def chosen() -> dict[int, str]:
    """What has been measured so far: {size bucket (log2 elements): selector name}."""
    with _lock:
        return dict(_fastest)


def select(mag: np.ndarray, k: int, name: str) -> np.ndarray:
    """The indices of the ``k`` largest entries of the non-negative ``mag`` by the named selector."""
    return SELECTORS[name](mag, k)
