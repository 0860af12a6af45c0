"""Vectorised NumPy kernels for reductions MPI cannot do itself (bfloat16, and float16 on MPIs without it)."""

from __future__ import annotations

import numpy as np

__all__ = ["bf16_to_f32", "f32_to_bf16", "combine", "reduce_into", "scale_into"]


def bf16_to_f32(words: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Widen bfloat16 words (uint16) to float32: bfloat16 is the top half of a float32."""
    wide = np.left_shift(words.astype(np.uint32), 16)
    if out is None:
        return wide.view(np.float32)
    out.view(np.uint32)[...] = wide
    return out


def f32_to_bf16(values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Round float32 to bfloat16 words with round-to-nearest-even; NaNs stay NaN."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    nan = np.isnan(values)
    if nan.any():
        rounded[nan] = (bits[nan] >> np.uint32(16)) | np.uint32(0x40)
    words = rounded.astype(np.uint16)
    if out is None:
        return words
    out[...] = words
    return out


_UFUNC = {"sum": np.add, "min": np.minimum, "max": np.maximum, "product": np.multiply}


def combine(a: np.ndarray, b: np.ndarray, out: np.ndarray, op: str, bfloat16: bool = False) -> None:
    """``out = op(a, b)`` elementwise (``out`` may be ``a``). 16-bit floats are combined in float32 and
    rounded once.

    ``op`` is one of ``sum``, ``min``, ``max``, ``product``. With ``bfloat16`` the arrays hold bfloat16 words.
    """
    ufunc = _UFUNC[op]
    if bfloat16:
        f32_to_bf16(ufunc(bf16_to_f32(a), bf16_to_f32(b)), out=out)
    elif out.dtype == np.float16:
        ufunc(a, b, out=out, dtype=np.float32, casting="same_kind")
    elif out.dtype == np.bool_:
        (np.logical_or if op in ("sum", "max") else np.logical_and)(a, b, out=out)
    else:
        ufunc(a, b, out=out)


def reduce_into(acc: np.ndarray, other: np.ndarray, op: str, bfloat16: bool = False) -> None:
    """``acc = op(acc, other)`` in place; see :func:`combine`."""
    combine(acc, other, acc, op, bfloat16)


def scale_into(src: np.ndarray, dst: np.ndarray, factor: float, bfloat16: bool = False) -> None:
    """``dst = src * factor`` (``src`` may be ``dst``). Integers truncate toward zero, as Horovod does."""
    if bfloat16:
        f32_to_bf16(bf16_to_f32(src) * np.float32(factor), out=dst)
    elif dst.dtype == np.bool_:
        if src is not dst:
            np.copyto(dst, src)
    elif dst.dtype == np.float16:  # multiply in float32 and round once, so small factors do not underflow
        np.multiply(src, np.float32(factor), out=dst, dtype=np.float32, casting="same_kind")
    elif dst.dtype.kind == "f":
        np.multiply(src, factor, out=dst)
    else:
        np.multiply(src, factor, out=dst, casting="unsafe")
