"""Write reference results computed by NumPy (and Python's repr) for native/tests/test_kernels_numpy.cc.

The native kernels replace perseus/transport/kernels.py, so their answers must be NumPy's: this script runs
the same operations on random data with NumPy and writes inputs and results to one binary file, which the
C++ test reads and compares bit for bit (NaNs only as NaNs, since NumPy's NaN payloads depend on the CPU
path it takes). bfloat16 references come from ml_dtypes when it is installed, else from the rounding rule
of perseus/transport/kernels.py.

Usage: python gen_reference.py OUT_FILE

Record layout (native byte order): int32 kind, int32 dtype, int32 op, int32 unused, float64 factor,
uint64 n, then the record's arrays (see KIND_* below).
"""

from __future__ import annotations

import struct
import sys
import unicodedata

import numpy as np

try:
    import ml_dtypes
except ImportError:  # the formula below is then the reference
    ml_dtypes = None

KIND_SCALE, KIND_COMBINE, KIND_H2F, KIND_F2H, KIND_F2BF, KIND_REPR_STR, KIND_REPR_DOUBLE, KIND_REPR_TUPLE, \
    KIND_REPR_LIST = range(1, 10)

# perseus.engine.messages.DType numbering; None marks bfloat16 (held as uint16 words).
DTYPES = {0: np.uint8, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.int64, 5: np.float16, 6: None,
          7: np.float32, 8: np.float64, 9: np.bool_, 10: np.uint16}
BF16 = 6
OPS = {1: np.add, 3: np.minimum, 4: np.maximum, 5: np.multiply}  # ReduceOp SUM, MIN, MAX, PRODUCT
BOOL_OPS = {1: np.logical_or, 3: np.logical_and, 4: np.logical_or, 5: np.logical_and}

rng = np.random.default_rng(20240611)
out = bytearray()


def header(kind: int, dtype: int = 0, op: int = 0, factor: float = 0.0, n: int = 0) -> None:
    out.extend(struct.pack("=iiiidQ", kind, dtype, op, 0, factor, n))


def blob(data: bytes) -> None:
    out.extend(struct.pack("=Q", len(data)))
    out.extend(data)


def bf16_to_f32(words: np.ndarray) -> np.ndarray:
    return (words.astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    values = np.ascontiguousarray(values, dtype=np.float32)
    if ml_dtypes is not None:
        with np.errstate(invalid="ignore"):  # NaNs are fine
            return values.astype(ml_dtypes.bfloat16).view(np.uint16)
    bits = values.view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    nan = np.isnan(values)
    rounded[nan] = (bits[nan] >> np.uint32(16)) | np.uint32(0x40)
    return rounded.astype(np.uint16)


def random_bits(n: int, dtype) -> np.ndarray:
    """Every bit pattern is fair game: NaNs, infinities, subnormals, signed zeros."""
    width = np.dtype(dtype).itemsize
    words = rng.integers(0, 256, size=n * width, dtype=np.uint8)
    return words.view(dtype)


def random_values(code: int, n: int, for_scale: float | None = None) -> np.ndarray:
    dtype = DTYPES[code]
    if code == BF16:
        return random_bits(n, np.uint16)
    if dtype is np.bool_:
        return rng.integers(0, 2, size=n).astype(np.bool_)
    if np.dtype(dtype).kind == "f":
        if dtype is np.float16:
            return random_bits(n, np.float16)
        # Mostly ordinary magnitudes, some random bit patterns for the special values.
        vals = (rng.standard_normal(n) * 10.0 ** rng.integers(-8, 8, size=n)).astype(dtype)
        special = rng.random(n) < 0.1
        vals[special] = random_bits(int(special.sum()), dtype)
        vals[:6] = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0], dtype)[: min(6, n)]
        return vals
    info = np.iinfo(dtype)
    if for_scale is None:
        return rng.integers(info.min, info.max, size=n, endpoint=True, dtype=dtype)
    # Scaled integers must stay in range: out-of-range casts are not defined by NumPy.
    limit = info.max if info.min == 0 else min(info.max, -info.min)
    bound = int(limit / max(1.0, abs(for_scale)) / 1.01)
    lo = 0 if info.min == 0 else -bound
    return rng.integers(lo, bound, size=n, endpoint=True, dtype=dtype)


def scale_reference(code: int, src: np.ndarray, factor: float) -> np.ndarray:
    dtype = DTYPES[code]
    if code == BF16:
        return f32_to_bf16(bf16_to_f32(src) * np.float32(factor))
    if dtype is np.bool_:
        return src.copy()
    if dtype is np.float16:  # multiply in float32, round once
        return (src.astype(np.float32) * np.float32(factor)).astype(np.float16)
    if np.dtype(dtype).kind == "f":
        return (src * dtype(factor)).astype(dtype)  # NumPy multiplies float32 by a Python float in float32
    return (src.astype(np.float64) * factor).astype(dtype)  # Horovod: in double, truncated toward zero


def combine_reference(code: int, op: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    dtype = DTYPES[code]
    with np.errstate(all="ignore"):
        if code == BF16:
            return f32_to_bf16(OPS[op](bf16_to_f32(a), bf16_to_f32(b)))
        if dtype is np.bool_:
            return BOOL_OPS[op](a, b)
        if dtype is np.float16:
            return OPS[op](a.astype(np.float32), b.astype(np.float32)).astype(np.float16)
        return OPS[op](a, b)


def kernels() -> None:
    for code, dtype in DTYPES.items():
        for factor in (0.5, 1.0 / 3.0, 0.1, 2.5, 1e-3, -0.75, 1e4, 1e-7):
            is_int = dtype is not None and np.dtype(dtype).kind in "iu"
            if is_int and (factor < 0 and np.dtype(dtype).kind == "u" or abs(factor) > 10 or abs(factor) < 1e-4):
                continue
            n = 4099
            src = random_values(code, n, for_scale=factor)
            with np.errstate(all="ignore"):
                ref = scale_reference(code, src, factor)
            header(KIND_SCALE, code, 0, factor, n)
            out.extend(src.tobytes())
            out.extend(np.ascontiguousarray(ref).tobytes())
        for op in OPS:
            n = 4101
            a, b = random_values(code, n), random_values(code, n)
            ref = combine_reference(code, op, a, b)
            header(KIND_COMBINE, code, op, 0.0, n)
            out.extend(a.tobytes())
            out.extend(b.tobytes())
            out.extend(np.ascontiguousarray(ref).tobytes())


def conversions() -> None:
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    header(KIND_H2F, n=halves.size)
    out.extend(halves.tobytes())
    out.extend(halves.view(np.float16).astype(np.float32).tobytes())

    # Random float32 bit patterns, then every half's neighbourhood: the exact midpoints to the next half
    # (ties) and the floats just either side of them.
    floats = [random_bits(1 << 20, np.float32)]
    finite = halves.view(np.float16)
    finite = finite[np.isfinite(finite)].astype(np.float64)
    finite = np.unique(np.concatenate([finite, [65536.0, -65536.0]]))
    mids = ((finite[:-1] + finite[1:]) / 2).astype(np.float32)  # exact: halves have 11 significant bits
    floats += [mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))]
    floats = np.concatenate(floats).astype(np.float32)
    header(KIND_F2H, n=floats.size)
    out.extend(floats.tobytes())
    with np.errstate(all="ignore"):
        out.extend(floats.astype(np.float16).view(np.uint16).tobytes())

    # bfloat16: random floats, and ties at every bfloat16 midpoint of a sample of exponents.
    words = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    f = bf16_to_f32(words)
    mids = (f.view(np.uint32) + np.uint32(0x8000)).view(np.float32)  # exact midpoint to the next word
    floats = np.concatenate([random_bits(1 << 20, np.float32), mids,
                             (mids.view(np.uint32) + np.uint32(1)).view(np.float32),
                             (mids.view(np.uint32) - np.uint32(1)).view(np.float32)])
    header(KIND_F2BF, n=floats.size)
    out.extend(floats.tobytes())
    out.extend(f32_to_bf16(floats).tobytes())


def printable_sample(count: int) -> list[str]:
    """Random assigned code points, weighted towards the tricky ones (controls, formats, spaces, quotes)."""
    tricky = [0, 1, 9, 10, 13, 27, 31, 32, 34, 39, 92, 126, 127, 0x80, 0x9F, 0xA0, 0xA1, 0xAD, 0xE9, 0x600,
              0x61C, 0x1680, 0x2000, 0x200B, 0x200D, 0x2028, 0x2029, 0x202F, 0x2060, 0x3000, 0x4E2D, 0xD7FB,
              0xE000, 0xF8FF, 0xFEFF, 0xFFFD, 0x1F642, 0xE0001, 0xE0041, 0xF0000, 0x10FFFD]
    pool = []
    while len(pool) < 4000:
        cp = int(rng.integers(0, 0x110000)) if rng.random() < 0.5 else int(rng.integers(0, 0x3000))
        if 0xD800 <= cp <= 0xDFFF or unicodedata.category(chr(cp)) == "Cn":
            continue  # surrogates cannot be UTF-8; the C++ side treats unassigned code points as printable
        pool.append(cp)
    pool += [cp for cp in tricky if unicodedata.category(chr(cp)) != "Cn"] * 20
    strings = []
    for _ in range(count):
        length = int(rng.integers(0, 12))
        strings.append("".join(chr(pool[int(i)]) for i in rng.integers(0, len(pool), size=length)))
    return strings


def reprs() -> None:
    strings = ["", "a", "grad/layer.0/weight", "it's", 'say "hi"', "both ' and \"", "back\\slash",
               "tab\t nl\n cr\r", "\x00\x01\x1f\x7f", "é ü 中文 🙂", "\x80\x9f\xa0\xad", "\u2028\u200b\ufeff",
               "\U000e0001", "'", '"', "'\"'"] + printable_sample(3000)
    for s in strings:
        raw = s.encode("utf-8")
        header(KIND_REPR_STR, n=len(raw))
        out.extend(raw)
        blob(repr(s).encode("utf-8"))
    doubles = [0.0, -0.0, 1.0, -1.0, 0.5, 0.1, 0.2 + 0.1, 1 / 3, 2 / 3, 1e16, 1e15, 9999999999999998.0,
               123456789012345678.0, 1e-4, 1e-5, 0.00012345, 1.5e-7, 5e-324, 2.2250738585072014e-308,
               1.7976931348623157e308, 1e22, 1e23, 1e100, 1e-100, 100.0, 12345.678, float("inf"),
               -float("inf"), float("nan"), 65504.0, 6.103515625e-05, 3.0517578125e-05]
    doubles += [float(x) for x in random_bits(2000, np.float64) if np.isfinite(x)]
    doubles += [float(x) for x in np.round(rng.standard_normal(1000) * 10.0 ** rng.integers(-6, 18, 1000), 3)]
    doubles += [float(np.float32(x)) for x in rng.standard_normal(500)]  # float32 values widened
    for d in doubles:
        header(KIND_REPR_DOUBLE, factor=d, n=1)
        blob(repr(d).encode())
    tuples = [(), (5,), (2, 3), (0, 0, 0), (-1, 12345678901234, -9223372036854775808, 9223372036854775807)]
    for t in tuples:
        header(KIND_REPR_TUPLE, n=len(t))
        out.extend(struct.pack(f"={len(t)}q", *t))
        blob(repr(t).encode())
    lists = [[], [0], [0, 2], [-1, 2147483647, -2147483648]]
    for v in lists:
        header(KIND_REPR_LIST, n=len(v))
        out.extend(struct.pack(f"={len(v)}i", *v))
        blob(repr(v).encode())


if __name__ == "__main__":
    kernels()
    conversions()
    reprs()
    with open(sys.argv[1], "wb") as f:
        f.write(out)
    print(f"gen_reference: {len(out) >> 20} MiB of NumPy references (ml_dtypes: {ml_dtypes is not None})")
