"""Unit tests of the framework-neutral cast compressors and Compression namespace
(perseus.runtime.compression), with NumPy arrays standing in for a framework's tensors."""

from __future__ import annotations

import numpy as np
import pytest

from perseus import compression as lossy
from perseus.runtime.compression import CastCompressor, NoneCompressor, cast_compressors, compression_namespace

pytestmark = pytest.mark.timeout(60)


def _cast(array, dtype):
    return array.astype(dtype)


def _is_float(dtype) -> bool:
    return np.issubdtype(np.dtype(dtype), np.floating)


def test_fp16_casts_floats_and_restores_their_dtype():
    fp16, bf16 = cast_compressors("example.module", _cast, _is_float, np.float16)
    assert bf16 is None
    assert issubclass(fp16, CastCompressor)
    assert (fp16.__name__, fp16.__module__, fp16.__qualname__) == ("FP16Compressor", "example.module",
                                                                   "FP16Compressor")
    x = np.arange(6, dtype=np.float64)
    wire, ctx = fp16.compress(x)
    assert wire.dtype == np.float16 and ctx == np.float64
    back = fp16.decompress(wire, ctx)
    assert back.dtype == np.float64 and np.array_equal(back, x)


def test_non_floats_and_wire_dtype_travel_unchanged():
    fp16, _ = cast_compressors(__name__, _cast, _is_float, np.float16)
    for x in (np.arange(4, dtype=np.int32), np.ones(3, np.float16)):
        wire, ctx = fp16.compress(x)
        assert wire is x and ctx is None
        assert fp16.decompress(wire, ctx) is x


def test_bf16_class_uses_the_given_dtype():
    # float32 stands in for a framework's bfloat16 here (NumPy has none).
    fp16, bf16 = cast_compressors(__name__, _cast, _is_float, np.float16, np.float32)
    assert bf16.__name__ == "BF16Compressor" and bf16.wire_dtype is np.float32 and fp16 is not bf16
    wire, ctx = bf16.compress(np.ones(2, np.float64))
    assert wire.dtype == np.float32 and ctx == np.float64


def test_compression_namespace_lists_horovods_then_the_communicating_ones():
    fp16, _ = cast_compressors(__name__, _cast, _is_float, np.float16)
    ns = compression_namespace("example.module", lossy.REDUCERS, none=NoneCompressor, fp16=fp16)
    assert ns.__name__ == "Compression" and ns.__module__ == "example.module"
    assert ns.none is NoneCompressor and ns.fp16 is fp16
    assert not hasattr(ns, "bf16")
    for name, cls in lossy.REDUCERS.items():
        assert getattr(ns, name) is cls
        assert f"``{name}``" in ns.__doc__
    names = [k for k in vars(ns) if not k.startswith("__")]
    assert names == ["none", "fp16"] + list(lossy.REDUCERS)
