"""Gradient compression for PyTorch: 16-bit casts for the wire, and the compressors that run their own
collectives (top-k, random-k, sign, QSGD, PowerSGD; framework-neutral, in perseus.compression)."""

import torch

from perseus import compression as _lossy
from perseus.common.compression import CastCompressor, Compressor, NoneCompressor

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression"]


class _TorchCast(CastCompressor):
    @staticmethod
    def _cast(tensor, dtype):
        return tensor.type(dtype)

    @staticmethod
    def _is_float(dtype) -> bool:
        return dtype.is_floating_point


class FP16Compressor(_TorchCast):
    """Send floating-point tensors as float16."""

    wire_dtype = torch.float16


class BF16Compressor(_TorchCast):
    """Send floating-point tensors as bfloat16 (float32's range, so no overflow; perseus addition)."""

    wire_dtype = torch.bfloat16


class Compression:
    """The compressors: Horovod's (classes, not instances) and perseus's communicating ones, which are
    built with their parameters (``Compression.topk(0.01)``); see docs/compression.md."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


for _name, _cls in _lossy.REDUCERS.items():
    setattr(Compression, _name, _cls)
