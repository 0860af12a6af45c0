"""Unit tests for the NumPy kernels in perseus.transport.kernels (bfloat16 conversion, reduce, scale).

References are computed independently: bfloat16 rounding with Python integers and exact fractions,
reductions and scaling in float32/float64 NumPy or plain Python arithmetic.
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import numpy as np
import pytest

from perseus.transport.kernels import bf16_to_f32, f32_to_bf16, reduce_into, scale_into

pytestmark = pytest.mark.timeout(60)


# ----------------------------------------------------------------------------- independent references

def f32_from_bits(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def bits_of_f32(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def bf16_exact(word: int) -> Fraction:
    """Exact value of a finite bfloat16 word; the first non-finite magnitude (0x7F80) counts as 2**128."""
    sign = -1 if word & 0x8000 else 1
    exp = (word >> 7) & 0xFF
    mant = word & 0x7F
    if exp == 0xFF:
        assert mant == 0
        return sign * Fraction(2) ** 128
    if exp == 0:
        return sign * Fraction(mant, 128) * Fraction(2) ** -126
    return sign * (1 + Fraction(mant, 128)) * Fraction(2) ** (exp - 127)


def ref_bf16_word(f32_bits: int) -> int:
    """Round a float32 (given by its bits) to the nearest bfloat16 word, ties to even, by exact arithmetic.

    NaN inputs return None (the caller checks NaN-ness separately).
    """
    exp = (f32_bits >> 23) & 0xFF
    if exp == 0xFF:
        if f32_bits & 0x7FFFFF:
            return None
        return f32_bits >> 16  # +-inf
    value = Fraction(f32_from_bits(f32_bits))
    down = f32_bits >> 16           # truncation toward zero (same sign, smaller or equal magnitude)
    up = down + 1                   # next bfloat16 away from zero (may be inf)
    d_down = abs(value - bf16_exact(down))
    d_up = abs(bf16_exact(up) - value)
    if d_down < d_up:
        return down
    if d_up < d_down:
        return up
    return down if down % 2 == 0 else up


def ref_bf16_vec(values: np.ndarray) -> np.ndarray:
    """Vectorised reference round-to-nearest-even on int64 arithmetic (finite or inf inputs only)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.int64)
    upper, lower = bits >> 16, bits & 0xFFFF
    up = (lower > 0x8000) | ((lower == 0x8000) & ((upper & 1) == 1))
    return (upper + up.astype(np.int64)).astype(np.uint16)


def bf16_values(words: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 words, via Python structs (independent of bf16_to_f32)."""
    return np.array([f32_from_bits(int(w) << 16) for w in words.ravel()], np.float32).reshape(words.shape)


def is_nan_word(word: int) -> bool:
    return (word & 0x7F80) == 0x7F80 and (word & 0x7F) != 0


def random_finite_f32_bits(rng, n):
    bits = rng.integers(0, 1 << 32, size=n, dtype=np.uint64).astype(np.uint32)
    finite = ((bits >> 23) & 0xFF) != 0xFF
    return bits[finite]


def random_bf16_words(rng, n, lo_exp=100, hi_exp=150):
    """Finite, non-NaN bfloat16 words with exponents in [lo_exp, hi_exp) (moderate magnitudes)."""
    sign = rng.integers(0, 2, size=n) << 15
    exp = rng.integers(lo_exp, hi_exp, size=n) << 7
    mant = rng.integers(0, 128, size=n)
    return (sign | exp | mant).astype(np.uint16)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal as bit patterns, except that any NaN equals any NaN."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.kind == "f":
        nan_a, nan_b = np.isnan(a), np.isnan(b)
        if not np.array_equal(nan_a, nan_b):
            return False
        view = {2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
        return np.array_equal(a.view(view)[~nan_a], b.view(view)[~nan_b])
    return np.array_equal(a, b)


# ----------------------------------------------------------------------------- self-checks of the references

def test_reference_rounding_sanity():
    assert ref_bf16_word(bits_of_f32(1.0)) == 0x3F80
    assert ref_bf16_word(0x3F808000) == 0x3F80      # tie, even stays
    assert ref_bf16_word(0x3F818000) == 0x3F82      # tie, odd rounds up
    assert ref_bf16_word(0x3F807FFF) == 0x3F80
    assert ref_bf16_word(0x3F808001) == 0x3F81
    assert ref_bf16_word(0x7F7FFFFF) == 0x7F80      # max float32 rounds to inf
    assert ref_bf16_word(0x7F7F7FFF) == 0x7F7F
    assert float(bf16_exact(0x3F80)) == 1.0 and float(bf16_exact(0xC040)) == -3.0


# ----------------------------------------------------------------------------- bfloat16

def test_bf16_to_f32_every_word():
    words = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = bf16_to_f32(words)
    assert got.dtype == np.float32 and got.shape == words.shape
    expected = (words.astype(np.uint32) << 16)
    assert np.array_equal(got.view(np.uint32), expected)
    for w in (0x0000, 0x8000, 0x3F80, 0xBF80, 0x0001, 0x7F7F, 0x7F80, 0xFF80, 0x4049):
        assert bits_of_f32(float(got[w])) == w << 16 or np.isnan(got[w])


def test_bf16_to_f32_into_out():
    words = np.array([[0x3F80, 0xC000], [0x0000, 0x4120]], np.uint16)
    out = np.full((2, 2), 7.0, np.float32)
    ret = bf16_to_f32(words, out=out)
    assert ret is out
    assert out.tolist() == [[1.0, -2.0], [0.0, 10.0]]


def test_round_trip_of_every_bf16_word():
    words = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    back = f32_to_bf16(bf16_to_f32(words))
    assert back.dtype == np.uint16
    nan = np.array([is_nan_word(int(w)) for w in words])
    assert np.array_equal(back[~nan], words[~nan])       # exactly representable: unchanged
    assert all(is_nan_word(int(w)) for w in back[nan])    # NaN stays NaN
    assert np.array_equal(back[nan] & 0x8000, words[nan] & 0x8000)  # with its sign


def test_exactly_representable_values_survive():
    values = np.array([0.0, -0.0, 1.0, -1.0, 0.5, 3.0, 1.5, 256.0, -65536.0, 2.0 ** -126, 2.0 ** -133,
                       3.3895313892515355e38, 1.25, -0.15625], np.float32)
    words = f32_to_bf16(values)
    assert same_bits(bf16_to_f32(words), values)
    assert [ref_bf16_word(bits_of_f32(float(v))) for v in values] == words.tolist()


@pytest.mark.parametrize("upper", [0x3F80, 0x3F81, 0x3F82, 0x4049, 0x404A, 0xBF80, 0xBF81, 0x0000, 0x0001,
                                   0x8001, 0x7F7E, 0x7F7F, 0xFF7F, 0x0080, 0x007F])
@pytest.mark.parametrize("lower", [0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF])
def test_round_to_nearest_even(upper, lower):
    bits = (upper << 16) | lower
    value = np.array([bits], np.uint32).view(np.float32)
    got = int(f32_to_bf16(value)[0])
    expected = ref_bf16_word(bits)
    assert got == expected, f"0x{bits:08X}: got 0x{got:04X}, expected 0x{expected:04X}"
    if lower == 0x8000:  # a tie: result is the even neighbour
        assert got % 2 == 0
        assert got == (upper if upper % 2 == 0 else upper + 1)


def test_random_rounding_matches_exact_reference():
    rng = np.random.default_rng(1)
    bits = random_finite_f32_bits(rng, 3000)
    got = f32_to_bf16(bits.view(np.float32))
    expected = [ref_bf16_word(int(b)) for b in bits]
    assert got.tolist() == expected
    # and the vectorised reference agrees on many more
    many = random_finite_f32_bits(rng, 200000)
    assert np.array_equal(f32_to_bf16(many.view(np.float32)), ref_bf16_vec(many.view(np.float32)))


def test_inf_and_nan():
    bits = np.array([0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FBFFFFF,
                     0x7F80FFFF, 0x7FFFFFFF, 0xFFFFFFFF], np.uint32)
    got = f32_to_bf16(bits.view(np.float32))
    assert int(got[0]) == 0x7F80 and int(got[1]) == 0xFF80
    for b, w in zip(bits[2:], got[2:]):
        assert is_nan_word(int(w)), f"NaN 0x{int(b):08X} became 0x{int(w):04X}"
        assert (int(w) & 0x8000) == (int(b) >> 16 & 0x8000)
    back = bf16_to_f32(got)
    assert np.isposinf(back[0]) and np.isneginf(back[1]) and np.isnan(back[2:]).all()


def test_overflow_rounds_to_inf():
    values = np.array([3.4028234663852886e38, -3.4028234663852886e38, 3.3961e38], np.float32)
    got = f32_to_bf16(values)
    assert got.tolist() == [0x7F80, 0xFF80, ref_bf16_word(bits_of_f32(float(values[2])))]


def test_f32_to_bf16_into_out_and_float64_input():
    out = np.zeros((2, 2), np.uint16)
    values = np.array([[1.0, 1.00390625], [-2.0, np.nan]], np.float64)  # 1 + 2**-8 is a tie: stays 1.0
    ret = f32_to_bf16(values, out=out)
    assert ret is out
    assert out[0].tolist() == [0x3F80, 0x3F80] and int(out[1, 0]) == 0xC000
    assert is_nan_word(int(out[1, 1]))


def test_f32_to_bf16_leaves_input_untouched():
    values = np.array([1.1, np.nan, -7.3], np.float32)
    before = values.view(np.uint32).copy()
    f32_to_bf16(values)
    assert np.array_equal(values.view(np.uint32), before)


# ----------------------------------------------------------------------------- reduce_into

OPS = ["sum", "min", "max", "product"]
NP_OP = {"sum": np.add, "min": np.minimum, "max": np.maximum, "product": np.multiply}


@pytest.mark.parametrize("op", OPS)
def test_reduce_float16_in_float32_rounded_once(op):
    rng = np.random.default_rng(2)
    a = (rng.standard_normal(5000) * rng.choice([1e-6, 1e-3, 1.0, 30.0, 3e3], 5000)).astype(np.float16)
    b = (rng.standard_normal(5000) * rng.choice([1e-6, 1e-3, 1.0, 30.0, 3e3], 5000)).astype(np.float16)
    a[:4] = [np.inf, -np.inf, 65504, np.nan]
    b[:4] = [1.0, 2.0, 65504, 1.0]
    acc, other_before = a.copy(), b.copy()
    with np.errstate(over="ignore", invalid="ignore"):
        expected = NP_OP[op](a.astype(np.float32), b.astype(np.float32)).astype(np.float16)
        assert reduce_into(acc, b, op) is None
    assert acc.dtype == np.float16
    assert same_bits(acc, expected)
    assert same_bits(b, other_before)


def test_reduce_float16_sum_needs_single_rounding():
    # float16 spacing at 2048 is 2: the float32 sums 2049 and 2051 are ties and must round to even
    # (2048 and 2052); a tiny value doubles exactly.
    acc = np.array([2048, 2048, 1e-4], np.float16)
    other = np.array([1, 3, 1e-4], np.float16)
    reduce_into(acc, other, "sum")
    exact = [2048.0 + 1.0, 2048.0 + 3.0, 2 * float(np.float16(1e-4))]
    assert acc.tolist() == [2048.0, 2052.0, float(np.float16(exact[2]))]


@pytest.mark.parametrize("op", OPS)
def test_reduce_bfloat16_words(op):
    rng = np.random.default_rng(3)
    a = random_bf16_words(rng, 4000)
    b = random_bf16_words(rng, 4000)
    fa, fb = bf16_values(a), bf16_values(b)
    expected = ref_bf16_vec(NP_OP[op](fa, fb))
    acc = a.copy()
    reduce_into(acc, b, op, bfloat16=True)
    assert acc.dtype == np.uint16
    assert np.array_equal(acc, expected)


def test_reduce_bfloat16_small_examples():
    one, two, three, half = 0x3F80, 0x4000, 0x4040, 0x3F00
    acc = np.array([one, two, three, half], np.uint16)
    reduce_into(acc, np.array([one, three, half, half], np.uint16), "sum", bfloat16=True)
    assert bf16_values(acc).tolist() == [2.0, 5.0, 3.5, 1.0]
    # 256 + 1 = 257 is a tie between 256 and 258 in bfloat16: to even (256); 258 + 1 -> 260 (tie, to even)
    acc = np.array([0x4380, 0x4381], np.uint16)  # 256, 258
    reduce_into(acc, np.array([one, one], np.uint16), "sum", bfloat16=True)
    assert bf16_values(acc).tolist() == [256.0, 260.0]


@pytest.mark.parametrize("op", OPS)
def test_reduce_int32(op):
    rng = np.random.default_rng(4)
    a = rng.integers(-1000, 1000, size=1000).astype(np.int32)
    b = rng.integers(-1000, 1000, size=1000).astype(np.int32)
    py = {"sum": lambda x, y: x + y, "min": min, "max": max, "product": lambda x, y: x * y}[op]
    expected = np.array([py(int(x), int(y)) for x, y in zip(a, b)], np.int64)
    acc = a.copy()
    reduce_into(acc, b, op)
    assert acc.dtype == np.int32
    assert np.array_equal(acc.astype(np.int64), expected)


def test_reduce_int32_sum_wraps_like_c():
    acc = np.array([2 ** 31 - 1, -2 ** 31], np.int32)
    reduce_into(acc, np.array([1, -1], np.int32), "sum")
    assert acc.tolist() == [-2 ** 31, 2 ** 31 - 1]


@pytest.mark.parametrize("op", OPS)
def test_reduce_float64(op):
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal(1000), rng.standard_normal(1000)
    py = {"sum": lambda x, y: x + y, "min": min, "max": max, "product": lambda x, y: x * y}[op]
    expected = np.array([py(float(x), float(y)) for x, y in zip(a, b)])
    acc = a.copy()
    reduce_into(acc, b, op)
    assert same_bits(acc, expected)


@pytest.mark.parametrize("op,table", [
    ("sum", [False, True, True, True]),
    ("max", [False, True, True, True]),
    ("min", [False, False, False, True]),
    ("product", [False, False, False, True]),
])
def test_reduce_bool(op, table):
    acc = np.array([False, False, True, True])
    other = np.array([False, True, False, True])
    reduce_into(acc, other, op)
    assert acc.dtype == np.bool_
    assert acc.tolist() == table
    assert other.tolist() == [False, True, False, True]


def test_reduce_multidimensional_in_place():
    acc = np.arange(6, dtype=np.float32).reshape(2, 3)
    view = acc[:]
    reduce_into(acc, np.full((2, 3), 10, np.float32), "sum")
    assert view.tolist() == [[10, 11, 12], [13, 14, 15]]


# ----------------------------------------------------------------------------- scale_into

FACTORS_EXACT = [0.5, 2.0, -0.25, 1.0, 0.0]
FACTORS_INEXACT = [1 / 3, 0.1, 1 / 7, 1e5, 1e-8]


def _both_ways(src, factor, **kw):
    """Return (in place result, out of place result) and check src is unchanged out of place."""
    inplace = src.copy()
    scale_into(inplace, inplace, factor, **kw)
    dst = np.full_like(src, 3)
    before = src.copy()
    scale_into(src, dst, factor, **kw)
    assert np.array_equal(src.view(np.uint8), before.view(np.uint8)), "scale_into modified src"
    return inplace, dst


@pytest.mark.parametrize("factor", FACTORS_EXACT + FACTORS_INEXACT)
def test_scale_float32(factor):
    rng = np.random.default_rng(6)
    src = (rng.standard_normal(2000) * 100).astype(np.float32)
    # float32 product of src and float32(factor), rounded once: exact in float64, then one rounding
    expected = (src.astype(np.float64) * float(np.float32(factor))).astype(np.float32)
    for got in _both_ways(src, factor):
        assert got.dtype == np.float32
        assert same_bits(got, expected)


@pytest.mark.parametrize("factor", FACTORS_EXACT + FACTORS_INEXACT)
def test_scale_float64(factor):
    rng = np.random.default_rng(7)
    src = rng.standard_normal(1000) * 1e3
    expected = np.array([float(x) * factor for x in src])
    for got in _both_ways(src, factor):
        assert same_bits(got, expected)


def _f16_src():
    rng = np.random.default_rng(8)
    src = (rng.standard_normal(2000) * 10).astype(np.float16)
    src[:6] = [0.001, 60000.0, 1.7001953125, 0.300048828125, -3.0, 1.099609375]
    return src


@pytest.mark.parametrize("factor", FACTORS_EXACT)
def test_scale_float16_dyadic_factors(factor):
    src = _f16_src()
    with np.errstate(over="ignore"):
        expected = (src.astype(np.float32) * np.float32(factor)).astype(np.float16)
        results = _both_ways(src, factor)
    for got in results:
        assert got.dtype == np.float16
        assert same_bits(got, expected)


@pytest.mark.parametrize("factor", FACTORS_INEXACT)
def test_scale_float16_in_float32(factor):
    src = _f16_src()
    with np.errstate(over="ignore"):
        expected = (src.astype(np.float32) * np.float32(factor)).astype(np.float16)
        results = _both_ways(src, factor)
    for got in results:
        assert same_bits(got, expected)


@pytest.mark.parametrize("x,factor,expected", [
    (1.7001953125, 0.1, 0.1700439453125),     # gets 0.169921875 (factor became 0.0999755859375)
    (0.001, 1e5, 100.0625),                   # gets inf (1e5 overflows float16)
    (60000.0, 1e-8, 0.0005998611450195312),   # gets 0 (1e-8 underflows float16)
])
def test_scale_float16_examples(x, factor, expected):
    assert float(np.float16(np.float32(np.float16(x)) * np.float32(factor))) == expected  # the reference
    src = np.array([x], np.float16)
    dst = np.zeros(1, np.float16)
    with np.errstate(over="ignore"):
        scale_into(src, dst, factor)
    assert float(dst[0]) == expected


@pytest.mark.parametrize("factor", FACTORS_EXACT + FACTORS_INEXACT)
def test_scale_bfloat16(factor):
    rng = np.random.default_rng(9)
    src = random_bf16_words(rng, 3000, 90, 160)
    expected = ref_bf16_vec(bf16_values(src) * np.float32(factor))
    for got in _both_ways(src, factor, bfloat16=True):
        assert got.dtype == np.uint16
        assert np.array_equal(got, expected)


def test_scale_bfloat16_examples():
    src = np.array([0x3F80, 0x4040, 0xC0A0], np.uint16)  # 1, 3, -5
    inplace, out = _both_ways(src, 0.5, bfloat16=True)
    assert bf16_values(inplace).tolist() == bf16_values(out).tolist() == [0.5, 1.5, -2.5]


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.int16, np.int8])
@pytest.mark.parametrize("factor", [0.5, -0.5, 1.5, 0.3, 2.0, 1.0 / 3.0, 0.0])
def test_scale_integers_truncate_toward_zero(dtype, factor):
    values = [7, -7, 5, -5, 3, -3, 1, -1, 0, 50, -50, 9, 21]
    src = np.array(values, dtype)
    expected = [math.trunc(v * factor) for v in values]
    for got in _both_ways(src, factor):
        assert got.dtype == dtype
        assert got.tolist() == expected


def test_scale_integer_examples():
    a = np.array([7, -7], np.int32)
    scale_into(a, a, 0.5)
    assert a.tolist() == [3, -3]
    b = np.array([7, -7], np.int64)
    out = np.zeros(2, np.int64)
    scale_into(b, out, 0.5)
    assert out.tolist() == [3, -3] and b.tolist() == [7, -7]


@pytest.mark.parametrize("factor", [0.0, 0.5, 2.0, -1.0])
def test_scale_bool_untouched(factor):
    src = np.array([True, False, True, False])
    inplace = src.copy()
    scale_into(inplace, inplace, factor)
    assert inplace.tolist() == [True, False, True, False]
    dst = np.array([False, True, False, True])
    scale_into(src, dst, factor)
    assert dst.tolist() == [True, False, True, False]
    assert src.tolist() == [True, False, True, False]


def test_scale_into_views_of_a_larger_buffer():
    buf = np.arange(10, dtype=np.float32)
    scale_into(buf[2:5], buf[6:9], 2.0)
    assert buf.tolist() == [0, 1, 2, 3, 4, 5, 4, 6, 8, 9]
