"""Gradient compression for MXNet: cast floating-point NDArrays to float16 for the wire and back."""

import numpy as np

from perseus.common.compression import CastCompressor, Compressor, NoneCompressor

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "Compression"]


class FP16Compressor(CastCompressor):
    """Send floating-point NDArrays as float16; other dtypes travel unchanged."""

    wire_dtype = np.float16

    @staticmethod
    def _cast(tensor, dtype):
        return tensor.astype(dtype, copy=False)

    @staticmethod
    def _is_float(dtype) -> bool:
        return np.issubdtype(np.dtype(dtype), np.floating)


class Compression:
    """The compressors, as Horovod names them (classes, not instances)."""

    none = NoneCompressor
    fp16 = FP16Compressor
