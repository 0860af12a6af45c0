"""Gradient compression for TensorFlow: 16-bit casts for the wire, and the compressors that run their own
collectives (top-k, random-k, sign, QSGD, PowerSGD; framework-neutral, in perseus.compression)."""

from __future__ import annotations

import tensorflow as tf

from perseus import compression as _lossy
from perseus.common.compression import CastCompressor, Compressor, NoneCompressor

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression"]


class _TFCast(CastCompressor):
    @staticmethod
    def _cast(tensor, dtype):
        return tf.cast(tensor, dtype)

    @staticmethod
    def _is_float(dtype) -> bool:
        return dtype.is_floating


class FP16Compressor(_TFCast):
    """Send floating-point tensors as float16."""

    wire_dtype = tf.float16


class BF16Compressor(_TFCast):
    """Send floating-point tensors as bfloat16 (float32's range, so no overflow; a perseus addition)."""

    wire_dtype = tf.bfloat16


class Compression:
    """The compressors: Horovod's (classes, not instances) and perseus's communicating ones, which are
    built with their parameters (``Compression.topk(0.01)``); see docs/compression.md."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


for _name, _cls in _lossy.REDUCERS.items():
    setattr(Compression, _name, _cls)
if Compression.__doc__:  # None under python -OO
    Compression.__doc__ += ("\n\n    The communicating ones: "
                            + ", ".join(f"``{name}``" for name in _lossy.REDUCERS) + ".")
