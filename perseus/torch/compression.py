"""Gradient compression for PyTorch: cast floating-point tensors to 16 bits for the wire and back."""

import torch

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
    """The compressors, as Horovod names them (classes, not instances)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
