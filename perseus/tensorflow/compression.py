"""Gradient compression for TensorFlow: cast floating-point tensors to 16 bits for the wire and back."""

from __future__ import annotations

import tensorflow as tf

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
    """The compressors, as Horovod names them (classes, not instances)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
