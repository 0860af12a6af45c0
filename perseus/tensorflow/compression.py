"""Gradient compression for TensorFlow: 16-bit casts for the wire, and the compressors that run their own
collectives (top-k, random-k, sign, QSGD, PowerSGD; framework-neutral, in perseus.compression)."""

from __future__ import annotations

import tensorflow as tf

from perseus import compression as _lossy
from perseus.runtime.compression import Compressor, NoneCompressor, cast_compressors, compression_namespace

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression"]


def _is_float(dtype) -> bool:
    return dtype.is_floating


FP16Compressor, BF16Compressor = cast_compressors(__name__, tf.cast, _is_float, tf.float16, tf.bfloat16)

Compression = compression_namespace(__name__, _lossy.REDUCERS, none=NoneCompressor, fp16=FP16Compressor,
                                    bf16=BF16Compressor)
