"""QSGD: stochastic quantisation to a few levels per entry (Alistarh et al., 2017).

Each rank quantises ``p`` (the gradient, plus the residual when error feedback is on) against its L2 norm:
``q_i = sign(p_i) * floor(|p_i| / ||p|| * s + u_i)`` with ``u_i`` uniform in [0, 1) and ``s = levels``, so
``q_i`` is an integer in [-s, s] and ``E[q_i] * ||p|| / s = p_i``: the compressor is unbiased, and error
feedback is off by default. The integers travel as int8 (``levels <= 127``), two to a byte when
``levels <= 7``, followed by the float32 ``||p|| / s``; the payloads are gathered (one allgather) and every
rank adds ``q_r * (||p_r|| / s)`` for r in rank order, so every rank gets bitwise the same result.

The uniforms come from a generator seeded from ``(seed, rank in the process set, crc32(key), step)``:
independent across ranks and steps, and reproducible.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from perseus.compression.base import KeyState, Reducer, key_hash, signature

__all__ = ["QSGD"]

_TRAILER = 8  # float32 scale (norm / levels), uint32 size signature


def pack4(q: np.ndarray, out: np.ndarray, half: np.ndarray) -> np.ndarray:
    """Pack int8 values in [-8, 7] (``q``, of even length) two to a byte: entry 2i in the low nibble of
    ``out[i]``, entry 2i+1 in the high one. ``half`` is scratch of ``out``'s size."""
    u = q.view(np.uint8)
    np.bitwise_and(u[0::2], np.uint8(0x0F), out=out)
    np.left_shift(u[1::2], np.uint8(4), out=half)
    np.bitwise_or(out, half, out=out)
    return out


def unpack4(packed: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Inverse of :func:`pack4`: ``out`` (int8, twice ``packed``'s length) gets the sign-extended nibbles."""
    signed = packed.view(np.int8)
    np.right_shift(signed, np.int8(4), out=out[1::2])
    np.left_shift(packed, np.uint8(4), out=out.view(np.uint8)[0::2])
    np.right_shift(out[0::2], np.int8(4), out=out[0::2])
    return out


class QSGD(Reducer):
    """Send every entry stochastically rounded to one of ``2 * levels + 1`` levels, and the norm.

    Args:
        levels: quantisation levels per sign, in [1, 127] (127: int8 per entry; 7 or fewer: 4 bits per entry).
        seed: a non-negative int, mixed with the rank, the key and the step to seed the rounding.
        error_feedback: keep what the rounding lost and add it to the next step's gradient (default False:
            QSGD is unbiased).

    Collective: every rank reduces the same keys with the same sizes and levels.

    Payload: uint8 ``[q (n int8, or ceil(n / 2) bytes of two 4-bit two's-complement values, low nibble first,
    when levels <= 7), scale = ||p|| / levels (float32), size signature (uint32)]``, gathered by one allgather.

    Raises:
        ValueError: levels outside [1, 127], or a negative or non-integer seed.
        MismatchError: (from the wait, on every rank) the ranks' gradients under one name differ in size, or
            the ranks use different levels.
    """

    kind = "qsgd"
    collective = "allgather"
    default_error_feedback = False

    def __init__(self, levels: int = 127, seed: int = 0, error_feedback: Optional[bool] = None):
        super().__init__(error_feedback)
        if isinstance(levels, bool) or not isinstance(levels, (int, np.integer)) or not 1 <= levels <= 127:
            raise ValueError(f"perseus: Compression.qsgd(levels): an int in [1, 127], got {levels!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"perseus: Compression.qsgd(seed=): a non-negative int, got {seed!r}")
        self.levels = int(levels)
        self.seed = int(seed)
        self.packed = self.levels <= 7

    def _describe(self) -> str:
        return f"levels={self.levels}, seed={self.seed}, error_feedback={self.error_feedback}"

    def body_len(self, n: int) -> int:
        """Bytes of quantised values for ``n`` entries."""
        return (n + 1) // 2 if self.packed else n

    def _buffers(self, n: int, st: KeyState) -> dict:
        ex = st.extra
        if "payload" not in ex:
            nb = self.body_len(n)
            ex["payload"] = np.empty(nb + _TRAILER, np.uint8)
            ex["tmp"] = np.empty(n, np.float32)
            ex["u"] = np.empty(n, np.float32)
            ex["dense"] = np.empty(n, np.float32)
            ex["sig"] = signature("qsgd", n, self.levels)
            if self.packed:
                ex["q8"] = np.zeros(2 * nb, np.int8)
                ex["half"] = np.empty(nb, np.uint8)
        return ex

    def _encode(self, acc: np.ndarray, st: KeyState):
        n = acc.size
        ex = self._buffers(n, st)
        payload, tmp, u = ex["payload"], ex["tmp"], ex["u"]
        nb = self.body_len(n)
        s = np.float32(self.levels)
        np.abs(acc, out=tmp)
        amax = float(tmp.max()) if n else 0.0
        if amax == 0.0 or not np.isfinite(amax):
            # all zero: nothing to send; inf/nan: a NaN scale makes every rank's result NaN, as a dense
            # reduction of a non-finite gradient would be non-finite
            scale = np.float32(0.0 if amax == 0.0 else np.nan)
            tmp.fill(0.0)
        else:
            tmp *= np.float32(1.0 / amax)  # |p| / max|p|: the squares below cannot overflow
            root = float(np.sqrt(np.dot(tmp, tmp)))
            scale = np.float32(amax * root / self.levels)
            tmp *= np.float32(self.levels / root)  # |p| / ||p|| * s
            rng = np.random.default_rng([self.seed, st.rank, key_hash(st.key), st.step])
            rng.random(out=u, dtype=np.float32)
            tmp += u
            np.floor(tmp, out=tmp)
            np.minimum(tmp, s, out=tmp)  # rounding in |p| / ||p|| * s may reach just past s
            np.copysign(tmp, acc, out=tmp)
        if self.packed:
            q8 = ex["q8"]
            np.copyto(q8[:n], tmp, casting="unsafe")
            pack4(q8, payload[:nb], ex["half"])
        else:
            np.copyto(payload[:n].view(np.int8), tmp, casting="unsafe")
        payload[nb:nb + 4].view(np.float32)[0] = scale
        payload[nb + 4:].view(np.uint32)[0] = ex["sig"]
        if self.error_feedback:
            tmp *= scale  # exactly what the receivers compute from (q, scale)
            acc -= tmp
        return payload, None

    def _values(self, seg: np.ndarray, n: int, ex: dict, out: np.ndarray) -> np.ndarray:
        """``q * scale`` (float32) of one rank's payload ``seg``, into ``out``."""
        nb = self.body_len(n)
        if self.packed:
            q8 = unpack4(seg[:nb], ex["q8"])
            np.copyto(out, q8[:n])
        else:
            np.copyto(out, seg[:n].view(np.int8))
        out *= seg[nb:nb + 4].view(np.float32)[0]
        return out

    def _decode(self, data: np.ndarray, splits, ctx, st: KeyState) -> np.ndarray:
        n = st.size
        ex = self._buffers(n, st)
        nb = self.body_len(n)
        seg_len = nb + _TRAILER
        dense, tmp, sig = ex["dense"], ex["tmp"], ex["sig"]
        offsets = range(0, seg_len * len(splits), seg_len)
        if any(int(s) != seg_len for s in splits) or any(
                data[off + nb + 4:off + seg_len].view(np.uint32)[0] != sig for off in offsets):
            raise self._mismatch(st, "the size (or the levels)")
        dense.fill(0.0)
        for off in offsets:
            dense += self._values(data[off:off + seg_len], n, ex, tmp)
        return dense
