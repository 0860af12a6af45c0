"""Gradient compression for PyTorch: 16-bit casts for the wire, and the compressors that run their own
collectives (top-k, random-k, sign, QSGD, PowerSGD; framework-neutral, in perseus.compression)."""

import torch

from perseus import compression as _lossy
from perseus.runtime.compression import Compressor, NoneCompressor, cast_compressors, compression_namespace

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression"]


def _cast(tensor, dtype):
    return tensor.type(dtype)


def _is_float(dtype) -> bool:
    return dtype.is_floating_point


FP16Compressor, BF16Compressor = cast_compressors(__name__, _cast, _is_float, torch.float16, torch.bfloat16)

Compression = compression_namespace(__name__, _lossy.REDUCERS, none=NoneCompressor, fp16=FP16Compressor,
                                    bf16=BF16Compressor)
