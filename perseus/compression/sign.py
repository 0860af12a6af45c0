"""Scaled sign compression with error feedback (EF-signSGD, Karimireddy et al., 2019).

Each rank compresses ``p = gradient + residual`` to ``scale * sign(p)`` with ``scale = mean(|p|)`` (the L1
norm over n), sending one bit per entry and one float32: 32 times less than the gradient. ``sign(0)`` is
taken as +1, on the sending and the receiving side alike. The payloads are gathered (one allgather) and
every rank adds ``scale_r * sign_r`` for r in rank order, so every rank gets bitwise the same result. The
residual keeps ``p - scale * sign(p)``: without it the sign is a biased compressor that does not converge
in general; with it signSGD matches SGD's rates.
"""

from __future__ import annotations


import numpy as np

from perseus.compression.base import KeyState, Reducer, signature

__all__ = ["Sign"]

_TRAILER = 8  # float32 scale, uint32 size signature


def signed(bits: np.ndarray, scale: np.float32, out: np.ndarray) -> np.ndarray:
    """``out[i] = scale if bits[i] else -scale``, computed the same way by the sender and the receivers
    (``bits * 2 scale - scale`` is exact in float32)."""
    np.copyto(out, bits)
    out *= np.float32(2.0) * scale
    out -= scale
    return out


class Sign(Reducer):
    """Send the sign of every entry (1 bit) and the mean magnitude.

    Args:
        error_feedback: keep ``p - scale * sign(p)`` and add it to the next step's gradient (default True).

    Collective: every rank reduces the same keys with the same sizes.

    Payload: uint8 ``[sign bits (ceil(n / 8), np.packbits order, 1 = non-negative), scale (float32), size
    signature (uint32)]``, gathered by one allgather.

    Raises:
        MismatchError: (from the wait, on every rank) the ranks' gradients under one name differ in size.
    """

    kind = "sign"
    collective = "allgather"

    def _encode(self, acc: np.ndarray, st: KeyState):
        n = acc.size
        nb = (n + 7) // 8
        ex = st.extra
        payload = ex.get("payload")
        if payload is None:
            payload = ex["payload"] = np.empty(nb + _TRAILER, np.uint8)
            ex["bits"] = np.empty(n, np.bool_)
            ex["tmp"] = np.empty(n, np.float32)
            ex["dense"] = np.empty(n, np.float32)
            ex["sig"] = signature("sign", n)
        bits, tmp = ex["bits"], ex["tmp"]
        np.abs(acc, out=tmp)
        scale = np.float32(tmp.sum(dtype=np.float64) / n) if n else np.float32(0.0)
        np.greater_equal(acc, 0.0, out=bits)
        payload[:nb] = np.packbits(bits)
        payload[nb:nb + 4].view(np.float32)[0] = scale
        payload[nb + 4:].view(np.uint32)[0] = ex["sig"]
        if self.error_feedback:
            acc -= signed(bits, scale, tmp)
        return payload, None

    def _decode(self, data: np.ndarray, splits, ctx, st: KeyState) -> np.ndarray:
        n = st.size
        nb = (n + 7) // 8
        ex = st.extra
        dense, tmp, sig = ex["dense"], ex["tmp"], ex["sig"]
        seg_len = nb + _TRAILER
        if any(int(s) != seg_len for s in splits) or any(
                data[off + nb + 4:off + seg_len].view(np.uint32)[0] != sig
                for off in range(0, seg_len * len(splits), seg_len)):
            raise self._mismatch(st, "the size")
        dense.fill(0.0)
        for off in range(0, seg_len * len(splits), seg_len):
            scale = data[off + nb:off + nb + 4].view(np.float32)[0]
            bits = np.unpackbits(data[off:off + nb], count=n).view(np.bool_)
            dense += signed(bits, scale, tmp)
        return dense
