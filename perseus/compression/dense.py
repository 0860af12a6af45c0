"""Dense all-reduce as a :class:`~perseus.compression.base.Reducer`: the "do not compress" option of
Espresso, in float32 or cast to float16 for the wire.

Not a user-facing compressor (``Compression.none``/``Compression.fp16`` go through the engine's own path);
it exists so that a wrapper choosing per gradient can route every option through the same interface.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from perseus.compression.base import KeyState, Reducer

__all__ = ["Dense"]

_DTYPES = {"float32": np.float32, "float16": np.float16}
_F16_MAX = np.float32(65504.0)


class Dense(Reducer):
    """Sum the (cast) gradient with one all-reduce; no residual unless ``error_feedback=True`` (then the
    float16 rounding error is carried to the next step).

    Args:
        dtype: ``'float32'`` (exact) or ``'float16'`` (half the bytes; values are saturated at +-65504,
            and a sum over the ranks beyond that overflows to infinity).

    Raises:
        ValueError: another dtype.
    """

    collective = "allreduce"
    default_error_feedback = False

    def __init__(self, dtype: str = "float32", error_feedback: Optional[bool] = None):
        super().__init__(error_feedback)
        if dtype not in _DTYPES:
            raise ValueError(f"perseus: Dense(dtype): 'float32' or 'float16', not {dtype!r}")
        self.dtype = dtype
        self._np = _DTYPES[dtype]
        self.kind = "dense" if dtype == "float32" else "fp16"

    def _describe(self) -> str:
        return f"dtype={self.dtype!r}, error_feedback={self.error_feedback}"

    def _encode(self, acc: np.ndarray, st: KeyState):
        if self._np is np.float32:
            payload = acc.copy() if self.error_feedback else acc
            if self.error_feedback:
                acc.fill(0.0)
            return payload, None
        payload = np.clip(acc, -_F16_MAX, _F16_MAX).astype(np.float16)
        if self.error_feedback:
            acc -= payload.astype(np.float32)
        return payload, None

    def _decode(self, data, splits, ctx, st: KeyState) -> np.ndarray:
        return data if data.dtype == np.float32 else data.astype(np.float32)
