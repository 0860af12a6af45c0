"""Gradient compression shared by the framework modules: the interface, the 16-bit cast compressors and the
``Compression`` namespace.

The cast logic (which tensors are cast, what the context carries) and the namespace are written once here; a
framework module calls :func:`cast_compressors` with its own cast, float test and dtypes, and
:func:`compression_namespace` with the classes it offers.
"""

__all__ = ["Compressor", "NoneCompressor", "CastCompressor", "cast_compressors", "compression_namespace"]


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
    """Send floating-point tensors as ``wire_dtype``; the context is the original dtype (None: untouched).

    A subclass sets ``wire_dtype`` and the framework's ``_cast(tensor, dtype)`` and ``_is_float(dtype)``
    (static methods); :func:`cast_compressors` builds such subclasses.
    """

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


_CAST_DOCS = {
    "FP16Compressor": "Send floating-point tensors as float16; other dtypes travel unchanged.",
    "BF16Compressor": "Send floating-point tensors as bfloat16 (float32's range, so no overflow; a perseus "
                      "addition); other dtypes travel unchanged.",
}


def _cast_class(name, wire_dtype, cast, is_float, module):
    return type(name, (CastCompressor,), {
        "wire_dtype": wire_dtype, "_cast": staticmethod(cast), "_is_float": staticmethod(is_float),
        "__doc__": _CAST_DOCS[name], "__module__": module, "__qualname__": name})


def cast_compressors(module, cast, is_float, float16, bfloat16=None):
    """A framework's 16-bit cast compressors: ``(FP16Compressor, BF16Compressor)`` classes.

    Args:
        module: the framework module's ``__name__``, given to the classes as their ``__module__``.
        cast: ``cast(tensor, dtype) -> tensor`` in the framework.
        is_float: ``is_float(dtype) -> bool``: whether tensors of ``dtype`` are floating point.
        float16, bfloat16: the framework's dtypes; ``bfloat16=None`` gives no BF16Compressor (None in its
            place).
    """
    fp16 = _cast_class("FP16Compressor", float16, cast, is_float, module)
    bf16 = None if bfloat16 is None else _cast_class("BF16Compressor", bfloat16, cast, is_float, module)
    return fp16, bf16


def compression_namespace(module, reducers, **compressors):
    """A framework's ``Compression`` class: Horovod's compressors (``none=``, ``fp16=``... as keyword
    arguments, classes, not instances) and the communicating ones of ``reducers`` (name -> class, built
    with their parameters: ``Compression.topk(0.01)``) as class attributes."""
    doc = ("The compressors: Horovod's (classes, not instances) and perseus's communicating ones, which are\n"
           "    built with their parameters (``Compression.topk(0.01)``); see docs/compression.md.\n\n"
           "    The communicating ones: " + ", ".join(f"``{name}``" for name in reducers) + ".")
    body = dict(compressors, **reducers)
    body.update(__doc__=doc, __module__=module, __qualname__="Compression")
    return type("Compression", (), body)
