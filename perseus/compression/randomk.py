"""Random-k sparsification with error feedback, reduced by a (small) dense allreduce.

Every rank picks the same ``k = ceil(density * n)`` coordinates of a gradient: a generator seeded from
``(seed, crc32(key), step)`` draws them, so the indices never travel. The payload is the k float32 values
at those coordinates (in increasing index order) followed by a 16-entry size check (see
:func:`perseus.compression.base.put_check`); the payloads are summed by one allreduce and every rank
scatters the sums back into a dense vector. Unlike top-k nothing is gathered: the payload does not grow
with the number of ranks.

Random-k without error feedback is unbiased only after rescaling by n/k (which inflates the variance by the
same factor); with error feedback (the default) the coordinates not sent this step stay in the residual and
go out in a later step, which is the usual way random-k is used.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from perseus.compression.base import CHECK_LEN, KeyState, Reducer, key_hash, put_check, signature, verify_check
from perseus.compression.local_step import check_warmup, density_at, mask_sent

__all__ = ["RandomK"]


class RandomK(Reducer):
    """Send the values of ``density * n`` coordinates chosen at random, the same on every rank.

    Args:
        density: fraction of entries sent per step, in (0, 1]; at least one entry is always sent.
        seed: a non-negative int; with the key's name and the step number it seeds the choice of coordinates.
            Every rank must use the same seed.
        error_feedback: keep what was not sent and add it to the next step's gradient (default True).
        warmup_steps, warmup_start: a density warm-up, as for :class:`perseus.compression.TopK`.
        momentum_correction, momentum_masking: as for :class:`perseus.compression.TopK`.

    A step at density 1 (all coordinates) is an ordinary all-reduce of the gradient.

    Collective: every rank reduces the same keys, in the same number of steps, with the same sizes, density
    and seed, and the same NumPy version (the choice comes from ``numpy.random.Generator.choice``).

    Payload: float32 ``[values (k), size check (16)]``, summed by one allreduce (Sum).

    Raises:
        ValueError: density outside (0, 1], or a negative or non-integer seed.
        MismatchError: (from the wait, on every rank) the ranks' gradients under one name differ in size, or
            the ranks use different densities or seeds.
    """

    kind = "randomk"
    collective = "allreduce"
    supports_local_step = True

    def __init__(self, density: float, seed: int = 0, error_feedback: Optional[bool] = None,
                 warmup_steps: int = 0, warmup_start: float = 0.25, momentum_correction: bool = True,
                 momentum_masking: Optional[bool] = None):
        super().__init__(error_feedback, momentum_correction, momentum_masking)
        density = float(density)
        if not 0.0 < density <= 1.0:
            raise ValueError(f"perseus: Compression.randomk(density): density must be in (0, 1], got {density}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"perseus: Compression.randomk(seed=): a non-negative int, got {seed!r}")
        self.density = density
        self.seed = int(seed)
        self.warmup_steps, self.warmup_start = check_warmup(warmup_steps, warmup_start, "Compression.randomk")

    def _describe(self) -> str:
        warmup = f", warmup_steps={self.warmup_steps}, warmup_start={self.warmup_start}" if self.warmup_steps else ""
        return (f"density={self.density}, seed={self.seed}, error_feedback={self.error_feedback}{warmup}, "
                f"momentum_correction={self.momentum_correction}, momentum_masking={self.momentum_masking}")

    def k_of(self, n: int, step: Optional[int] = None) -> int:
        """How many entries of an ``n``-entry gradient are sent (at ``step`` of a warm-up; None: after it)."""
        density = self.density if step is None else density_at(self.density, step, self.warmup_steps,
                                                                 self.warmup_start)
        return 0 if n == 0 else max(1, min(n, math.ceil(density * n)))

    def indices(self, key: str, n: int, step: int, k: Optional[int] = None) -> np.ndarray:
        """The coordinates sent for ``key`` (``n`` entries) at ``step`` (0 for the first call): ``k`` (default
        ``k_of(n, step)``) distinct int64 indices in increasing order, the same on every rank."""
        if k is None:
            k = self.k_of(n, step)
        rng = np.random.default_rng([self.seed, key_hash(key), int(step)])
        if k == n:
            return np.arange(n, dtype=np.int64)
        idx = rng.choice(n, size=k, replace=False, shuffle=False)
        idx.sort()
        return idx

    def _k_now(self, n: int, st: KeyState) -> int:
        """k at the key's current step (its warm-up, unless an adapter ran it already)."""
        return self.k_of(n, st.step if st.extra.get("ramp", True) else None)

    def _submit(self, key, st: KeyState, acc: np.ndarray, process_set, set_size: int):
        if acc.size and self._k_now(acc.size, st) == acc.size:  # every coordinate: a plain all-reduce
            return self._submit_whole(key, st, acc, process_set)
        return super()._submit(key, st, acc, process_set, set_size)

    def _encode(self, acc: np.ndarray, st: KeyState):
        n = acc.size
        k = self._k_now(n, st)
        ex = st.extra
        payload = ex.get("payload")
        if payload is None or payload.size != k + CHECK_LEN:  # (k changes during a warm-up)
            payload = ex["payload"] = np.empty(k + CHECK_LEN, np.float32)
            ex["dense"] = np.empty(n, np.float32)
            ex["sig"] = signature("randomk", n, k, self.seed)
        idx = self.indices(st.key, n, st.step, k)
        np.take(acc, idx, out=payload[:k])
        put_check(payload[k:], ex["sig"])
        if self.error_feedback:
            acc[idx] = 0.0
            mask_sent(st, idx)
        return payload, idx

    def _decode(self, data: np.ndarray, splits, ctx, st: KeyState) -> np.ndarray:
        idx = ctx
        k = idx.size
        if not verify_check(data[k:], st.extra["sig"], st.set_size):
            raise self._mismatch(st, "the size (or the density or seed)")
        dense = st.extra["dense"]
        dense.fill(0.0)
        dense[idx] = data[:k]
        return dense
