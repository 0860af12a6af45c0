"""Top-k sparsification with error feedback, reduced by a sparse allgather.

Each rank sends the ``k = ceil(density * n)`` entries of largest magnitude of (gradient + residual) as one
float32 payload ``[values (k), indices (k, int32 bits), signature (1, uint32 bits)]``; the payloads of all
ranks are gathered (one collective, sizes may differ) and every rank adds them into a dense vector in rank
order, so every rank gets bitwise the same result. The unsent entries stay in the residual for the next step.
The signature (a digest of n) lets every rank see that another rank reduced a gradient of a different size
under the same name, and raise, instead of adding indices from a different tensor.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from perseus.base.knobs import read_knob
from perseus.compression import selectors
from perseus.compression.base import CHECK_LEN, KeyState, Reducer, signature
from perseus.compression.local_step import check_warmup, density_at, mask_sent

__all__ = ["TopK", "sparse_sum"]


def sparse_sum(data: np.ndarray, splits, out: np.ndarray, trailer: int = 0) -> np.ndarray:
    """Add gathered ``[values, indices]`` payloads (one per rank, ``splits`` their lengths, each followed by
    ``trailer`` entries that are skipped) into ``out``, rank by rank; returns ``out`` (zeroed first)."""
    out.fill(0.0)
    off = 0
    for length in splits:
        length = int(length)
        k = (length - trailer) // 2
        seg = data[off:off + length]
        off += length
        if k:
            out[seg[k:2 * k].view(np.int32)] += seg[:k]
    return out


class TopK(Reducer):
    """Send the largest-magnitude ``density`` fraction of each gradient (values and int32 indices).

    Args:
        density: fraction of entries sent per step, in (0, 1]; at least one entry is always sent.
        error_feedback: keep what was not sent and add it to the next step's gradient (default True;
            without it top-k converges measurably worse).
        selector: 'auto' (the fastest measured for each size), 'exact', 'torch', 'mstopk' or 'dgc'; the
            default comes from PERSEUS_TOPK_SELECTOR.
        warmup_steps: the density falls exponentially from ``warmup_start`` to ``density`` over a gradient's
            first ``warmup_steps`` reductions (0: no warm-up). Every rank is at the same density at every
            step. Under a DistributedOptimizer wrapping Adam or AdamW the warm-up is dense instead (the
            variance is estimated, then frozen; default 100 steps; docs/compression.md).
        warmup_start: the density of the first step (default 0.25; 1.0 starts dense).
        momentum_correction: when the wrapped optimizer is SGD with momentum, apply the momentum on each
            rank before compressing (the optimizer then takes plain steps; docs/compression.md). Default on.
        momentum_masking: with momentum correction, zero the velocity of the entries a rank sent (None, the
            default: on for SGD, off for Adam, as measured; docs/compression.md).

    A step whose sparse payload would be at least as large as the dense gradient (a density of 0.5 or more:
    the start of a warm-up, a tiny gradient) sends the gradient whole through one all-reduce instead.

    Raises:
        ValueError: density outside (0, 1], a bad warm-up, an unknown selector, or a gradient of 2**31
            entries or more.
        MismatchError: (from the wait, on every rank) the ranks' gradients under one name differ in size.
    """

    kind = "topk"
    collective = "allgather"
    supports_local_step = True

    def __init__(self, density: float, error_feedback: Optional[bool] = None, selector: Optional[str] = None,
                 warmup_steps: int = 0, warmup_start: float = 0.25, momentum_correction: bool = True,
                 momentum_masking: Optional[bool] = None):
        super().__init__(error_feedback, momentum_correction, momentum_masking)
        density = float(density)
        if not 0.0 < density <= 1.0:
            raise ValueError(f"perseus: Compression.topk(density): density must be in (0, 1], got {density}")
        self.density = density
        self.warmup_steps, self.warmup_start = check_warmup(warmup_steps, warmup_start, "Compression.topk")
        self.selector = selector or read_knob("topk_selector")[0]
        if self.selector != "auto" and self.selector not in selectors.SELECTORS:
            raise ValueError(f"perseus: unknown top-k selector {self.selector!r}; choose one of "
                             f"{', '.join(['auto', *selectors.SELECTORS])}")

    def _describe(self) -> str:
        warmup = f", warmup_steps={self.warmup_steps}, warmup_start={self.warmup_start}" if self.warmup_steps else ""
        return (f"density={self.density}, error_feedback={self.error_feedback}, selector={self.selector!r}{warmup}, "
                f"momentum_correction={self.momentum_correction}, momentum_masking={self.momentum_masking}")

    def density_at(self, step: int) -> float:
        """The density in force at a gradient's ``step`` (0: its first reduction)."""
        return density_at(self.density, step, self.warmup_steps, self.warmup_start)

    def k_of(self, n: int, step: Optional[int] = None) -> int:
        """How many entries of an ``n``-entry gradient are sent (at ``step`` of a warm-up; None: after it)."""
        density = self.density if step is None else self.density_at(step)
        return max(1, min(n, math.ceil(density * n)))

    def _submit(self, key, st: KeyState, acc: np.ndarray, process_set, set_size: int):
        n = acc.size
        k = self.k_of(n, st.step if st.extra.get("ramp", True) else None)
        if k == n or 2 * k + 1 >= n + CHECK_LEN:  # every entry, or a payload no smaller than the gradient
            return self._submit_whole(key, st, acc, process_set)
        st.extra["k"] = k
        return super()._submit(key, st, acc, process_set, set_size)

    def _encode(self, acc: np.ndarray, st: KeyState):
        n = acc.size
        if n >= 2 ** 31:
            raise ValueError(f"perseus: Compression.topk: a gradient of {n} entries is too large for int32 "
                             "indices; split it")
        k = st.extra.get("k") or self.k_of(n)
        mag = st.extra.get("mag")
        if mag is None:
            mag = st.extra["mag"] = np.empty(n, np.float32)
            st.extra["dense"] = np.empty(n, np.float32)
            st.extra["selector"] = selectors.choice(n, self.density, self.selector)
        np.abs(acc, out=mag)
        idx = selectors.select(mag, k, st.extra["selector"])
        payload = np.empty(2 * k + 1, np.float32)
        np.take(acc, idx, out=payload[:k])
        payload[k:2 * k].view(np.int32)[:] = idx
        payload[2 * k:].view(np.uint32)[0] = st.extra.setdefault("sig", signature("topk", n))
        if self.error_feedback:
            acc[idx] = 0.0
            mask_sent(st, idx)
        return payload, None

    def _decode(self, data, splits, ctx, st: KeyState) -> np.ndarray:
        sig, off = st.extra["sig"], 0
        for length in splits:
            off += int(length)
            if length < 1 or data[off - 1:off].view(np.uint32)[0] != sig:
                raise self._mismatch(st, "the size")
        return sparse_sum(data, splits, st.extra["dense"], trailer=1)
