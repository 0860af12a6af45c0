"""Gradient compression for MXNet: a float16 cast for the wire, and the compressors that run their own
collectives (top-k, random-k, sign, QSGD, PowerSGD; framework-neutral, in perseus.compression)."""

import numpy as np

from perseus import compression as _lossy
from perseus.runtime.compression import Compressor, NoneCompressor, cast_compressors, compression_namespace

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "Compression"]


def _cast(tensor, dtype):
    return tensor.astype(dtype, copy=False)


def _is_float(dtype) -> bool:
    return np.issubdtype(np.dtype(dtype), np.floating)


FP16Compressor, _ = cast_compressors(__name__, _cast, _is_float, np.float16)

Compression = compression_namespace(__name__, _lossy.REDUCERS, none=NoneCompressor, fp16=FP16Compressor)
