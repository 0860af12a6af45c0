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

from perseus.common.knobs import read_knob
from perseus.compression import selectors
from perseus.compression.base import KeyState, Reducer, signature

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

    Raises:
        ValueError: density outside (0, 1], an unknown selector, or a gradient of 2**31 entries or more.
        MismatchError: (from the wait, on every rank) the ranks' gradients under one name differ in size.
    """

    kind = "topk"
    collective = "allgather"

    def __init__(self, density: float, error_feedback: Optional[bool] = None, selector: Optional[str] = None):
        super().__init__(error_feedback)
        density = float(density)
        if not 0.0 < density <= 1.0:
            raise ValueError(f"perseus: Compression.topk(density): density must be in (0, 1], got {density}")
        self.density = density
        self.selector = selector or read_knob("topk_selector")[0]
        if self.selector != "auto" and self.selector not in selectors.SELECTORS:
            raise ValueError(f"perseus: unknown top-k selector {self.selector!r}; choose one of "
                             f"{', '.join(['auto', *selectors.SELECTORS])}")

    def _describe(self) -> str:
        return f"density={self.density}, error_feedback={self.error_feedback}, selector={self.selector!r}"

    def k_of(self, n: int) -> int:
        """How many entries of an ``n``-entry gradient are sent."""
        return max(1, min(n, math.ceil(self.density * n)))

    def _encode(self, acc: np.ndarray, st: KeyState):
        n = acc.size
        if n >= 2 ** 31:
            raise ValueError(f"perseus: Compression.topk: a gradient of {n} entries is too large for int32 "
                             "indices; split it")
        k = self.k_of(n)
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
        return payload, None

    def _decode(self, data, splits, ctx, st: KeyState) -> np.ndarray:
        sig, off = st.extra["sig"], 0
        for length in splits:
            off += int(length)
            if length < 1 or data[off - 1:off].view(np.uint32)[0] != sig:
                raise self._mismatch(st, "the size")
        return sparse_sum(data, splits, st.extra["dense"], trailer=1)
