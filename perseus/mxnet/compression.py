"""Gradient compression for MXNet: a float16 cast for the wire, and the compressors that run their own
collectives (top-k, random-k, sign, QSGD, PowerSGD; framework-neutral, in perseus.compression)."""

import numpy as np

from perseus import compression as _lossy
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
    """The compressors: Horovod's (classes, not instances) and perseus's communicating ones, which are
    built with their parameters (``Compression.topk(0.01)``); see docs/compression.md."""

    none = NoneCompressor
    fp16 = FP16Compressor


for _name, _cls in _lossy.REDUCERS.items():
    setattr(Compression, _name, _cls)
if Compression.__doc__:  # None under python -OO
    Compression.__doc__ += ("\n\n    The communicating ones: "
                            + ", ".join(f"``{name}``" for name in _lossy.REDUCERS) + ".")
