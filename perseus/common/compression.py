"""Gradient compression shared by the framework modules: the interface and the 16-bit cast compressor.

A framework module subclasses :class:`CastCompressor` with its own ``_cast`` and ``_is_float`` and names the
wire dtype; the logic (which tensors are cast, what the context carries) lives here once.
"""

__all__ = ["Compressor", "NoneCompressor", "CastCompressor"]


class Compressor:
    """Interface: ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx) -> tensor``."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Send tensors as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class CastCompressor(Compressor):
    """Send floating-point tensors as ``wire_dtype``; the context is the original dtype (None: untouched)."""

    wire_dtype = None

    @staticmethod
    def _cast(tensor, dtype):
        raise NotImplementedError

    @staticmethod
    def _is_float(dtype) -> bool:
        raise NotImplementedError

    @classmethod
    def compress(cls, tensor):
        dtype = tensor.dtype
        if cls._is_float(dtype) and dtype != cls.wire_dtype:
            return cls._cast(tensor, cls.wire_dtype), dtype
        return tensor, None

    @classmethod
    def decompress(cls, tensor, ctx):
        return tensor if ctx is None else cls._cast(tensor, ctx)
