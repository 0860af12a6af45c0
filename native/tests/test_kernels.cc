// Tests for kernels.cc and common.cc: conversions and element-wise kernels against references computed
// in double, the Python-style repr helpers against known answers, and (with a file from gen_reference.py)
// everything against NumPy's and Python's own results. Exits 1 on any failure.
//
// Usage: test_kernels [REFERENCE_FILE]
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "../common.h"
#include "../kernels.h"

using namespace perseus;

namespace {

int g_checks = 0;
int g_failures = 0;

void fail(int line, const std::string& what) {
  ++g_failures;
  if (g_failures <= 40) std::fprintf(stderr, "test_kernels.cc:%d: FAILED: %s\n", line, what.c_str());
  if (g_failures == 40) std::fprintf(stderr, "(further failures not shown)\n");
}

#define EXPECT(cond, msg)                \
  do {                                   \
    ++g_checks;                          \
    if (!(cond)) {                       \
      std::ostringstream os_;            \
      os_ << #cond << ": " << msg;       \
      fail(__LINE__, os_.str());         \
    }                                    \
  } while (0)

std::string hex(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// -- references, written independently of kernels.cc: decode and round with ldexp/nearbyint in double --

double half_value(uint16_t h) {
  const int e = (h >> 10) & 31, m = h & 1023;
  double v;
  if (e == 0) {
    v = std::ldexp(m, -24);
  } else if (e == 31) {
    v = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else {
    v = std::ldexp(1024 + m, e - 25);
  }
  return (h & 0x8000) ? -v : v;
}

// Nearest half to v (ties to even); NaN is handled by the callers.
uint16_t half_ref(double v) {
  const uint16_t sign = std::signbit(v) ? 0x8000 : 0;
  const double a = std::fabs(v);
  if (a >= 65520.0) return sign | 0x7C00;
  if (a < std::ldexp(1.0, -14)) {
    return sign | static_cast<uint16_t>(std::nearbyint(std::ldexp(a, 24)));  // 1024 is the smallest normal
  }
  int ex;
  std::frexp(a, &ex);  // a = f * 2^ex, f in [0.5, 1)
  int exponent = ex - 1;
  double n = std::nearbyint(std::ldexp(a, 10 - exponent));  // in [1024, 2048]
  if (n == 2048) {
    n = 1024;
    ++exponent;
  }
  return sign | static_cast<uint16_t>(((exponent + 15) << 10) | (static_cast<int>(n) - 1024));
}

// Nearest bfloat16 to a float (ties to even); NaN is handled by the callers.
uint16_t bf16_ref(float f) {
  const double a = std::fabs(static_cast<double>(f));
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  if (std::isinf(a)) return sign | 0x7F80;
  double q;  // the spacing of bfloat16 values around a
  if (a < std::ldexp(1.0, -126)) {
    q = std::ldexp(1.0, -133);
  } else {
    int ex;
    std::frexp(a, &ex);
    q = std::ldexp(1.0, ex - 1 - 7);
  }
  const double r = std::nearbyint(a / q) * q;
  if (r >= std::ldexp(1.0, 128)) return sign | 0x7F80;
  return sign | static_cast<uint16_t>(bits_of(static_cast<float>(r)) >> 16);
}

bool is_half_nan(uint16_t h) { return (h & 0x7C00) == 0x7C00 && (h & 0x3FF); }
bool is_bf16_nan(uint16_t b) { return (b & 0x7F80) == 0x7F80 && (b & 0x7F); }

// -- conversions ---------------------------------------------------------------------------------------

void test_half_to_float() {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float got = half_to_float(static_cast<uint16_t>(h));
    const double want = half_value(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      EXPECT(std::isnan(got), "half " << hex(h) << " -> " << got);
      // The payload is kept: the half's mantissa lands in the float's top mantissa bits.
      EXPECT(((bits_of(got) >> 13) & 0x3FF) == (h & 0x3FF), "payload of " << hex(h));
    } else {
      EXPECT(static_cast<double>(got) == want && std::signbit(got) == std::signbit(want),
             "half " << hex(h) << " -> " << got << ", want " << want);
    }
  }
}

void test_float_to_half() {
  // Every half round-trips exactly.
  for (uint32_t h = 0; h < 65536; ++h) {
    if (is_half_nan(static_cast<uint16_t>(h))) continue;
    const uint16_t back = float_to_half(half_to_float(static_cast<uint16_t>(h)));
    EXPECT(back == h, "round trip of " << hex(h) << " gave " << hex(back));
  }
  // A sweep over float bit patterns (stride 257 reaches every low-bit pattern) against the reference.
  for (uint64_t u = 0; u <= 0xFFFFFFFFull; u += 257) {
    const float f = float_of(static_cast<uint32_t>(u));
    const uint16_t got = float_to_half(f);
    if (std::isnan(f)) {
      EXPECT(is_half_nan(got) && (got & 0x0200), hex(u) << " -> " << hex(got) << " is not a quiet NaN");
      EXPECT((got & 0x8000) == ((u >> 16) & 0x8000), "NaN sign of " << hex(u));
      continue;
    }
    const uint16_t want = half_ref(f);
    EXPECT(got == want, "float " << hex(u) << " (" << f << ") -> " << hex(got) << ", want " << hex(want));
  }
  // Known answers: ties to even, overflow, subnormals, signed zero.
  struct Case {
    float in;
    uint16_t want;
  };
  const Case cases[] = {
      {0.0f, 0x0000},
      {-0.0f, 0x8000},
      {1.0f, 0x3C00},
      {-2.0f, 0xC000},
      {65504.0f, 0x7BFF},                      // largest half
      {65519.996f, 0x7BFF},                    // just below the midpoint to 65536
      {65520.0f, 0x7C00},                      // the midpoint: ties to even = infinity
      {1e9f, 0x7C00},
      {-std::numeric_limits<float>::infinity(), 0xFC00},
      {std::ldexp(1.0f, -24), 0x0001},         // smallest subnormal
      {std::ldexp(1.0f, -25), 0x0000},         // half of it: tie to even = 0
      {std::ldexp(1.5f, -25), 0x0001},         // above the tie
      {std::ldexp(3.0f, -25), 0x0002},         // 1.5 * 2^-24: tie between 1 and 2 -> 2
      {std::ldexp(5.0f, -25), 0x0002},         // 2.5 * 2^-24: tie between 2 and 3 -> 2
      {std::ldexp(1.0f, -14), 0x0400},         // smallest normal
      {std::ldexp(1023.5f, -24), 0x0400},      // subnormal rounding up into the normals (tie to even)
      {1.0f + std::ldexp(1.0f, -11), 0x3C00},  // tie between 1 and 1+2^-10 -> 1 (even)
      {1.0f + std::ldexp(3.0f, -11), 0x3C02},  // tie between 1+2^-10 and 1+2^-9 -> even mantissa 2
      {std::ldexp(1.0f, -130), 0x0000},        // a float subnormal
      {std::numeric_limits<float>::denorm_min(), 0x0000},
  };
  for (const Case& c : cases) {
    const uint16_t got = float_to_half(c.in);
    EXPECT(got == c.want, c.in << " -> " << hex(got) << ", want " << hex(c.want));
  }
  EXPECT(float_to_half(float_of(0x7F800001u)) == 0x7E00, "signalling NaN -> quiet NaN");
  EXPECT(float_to_half(float_of(0xFFC00000u)) == 0xFE00, "negative quiet NaN");
}

void test_bf16() {
  for (uint64_t u = 0; u <= 0xFFFFFFFFull; u += 257) {
    const float f = float_of(static_cast<uint32_t>(u));
    const uint16_t got = float_to_bf16(f);
    if (std::isnan(f)) {
      EXPECT(is_bf16_nan(got) && (got & 0x40), hex(u) << " -> " << hex(got) << " is not a quiet NaN");
      continue;
    }
    const uint16_t want = bf16_ref(f);
    EXPECT(got == want, "float " << hex(u) << " -> " << hex(got) << ", want " << hex(want));
  }
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = bf16_to_float(static_cast<uint16_t>(b));
    EXPECT(bits_of(f) == (b << 16), "bf16 " << hex(b));
    if (!is_bf16_nan(static_cast<uint16_t>(b))) {
      EXPECT(float_to_bf16(f) == b, "round trip of bf16 " << hex(b));
      // The exact midpoint to the next word rounds to the even one of the two.
      const uint16_t tie = float_to_bf16(float_of((b << 16) | 0x8000u));
      const uint32_t next = (b + 1) & 0xFFFF;
      if ((b & 0x7F80) != 0x7F80) {
        EXPECT(tie == ((b & 1) ? next : b), "tie above bf16 " << hex(b) << " -> " << hex(tie));
      }
    }
  }
  EXPECT(float_to_bf16(float_of(0x7F800001u)) == 0x7FC0, "a NaN that truncates to inf stays NaN");
  EXPECT(float_to_bf16(float_of(0xFF800001u)) == 0xFFC0, "negative NaN");
  EXPECT(float_to_bf16(std::numeric_limits<float>::max()) == 0x7F80, "FLT_MAX rounds to inf");
  EXPECT(float_to_bf16(float_of(0x3F808000u)) == 0x3F80, "tie to even (down)");
  EXPECT(float_to_bf16(float_of(0x3F818000u)) == 0x3F82, "tie to even (up)");
  EXPECT(float_to_bf16(float_of(0x00000001u)) == 0x0000, "smallest float subnormal");
  EXPECT(float_to_bf16(float_of(0x00008000u)) == 0x0000, "subnormal tie to even");
  EXPECT(float_to_bf16(float_of(0x00018000u)) == 0x0002, "subnormal tie to even (up)");
}

// -- element-wise kernels ------------------------------------------------------------------------------

const DType kDTypes[] = {DType::UINT8,   DType::INT8,    DType::INT16,   DType::INT32,
                         DType::INT64,   DType::FLOAT16, DType::BFLOAT16, DType::FLOAT32,
                         DType::FLOAT64, DType::BOOL,    DType::UINT16};
const ReduceOp kOps[] = {ReduceOp::SUM, ReduceOp::MIN, ReduceOp::MAX, ReduceOp::PRODUCT, ReduceOp::AVERAGE};

// Element i of a buffer as a double, and the reverse (exact for the values these tests use).
double get(DType d, const void* p, size_t i) {
  switch (d) {
    case DType::UINT8: return static_cast<const uint8_t*>(p)[i];
    case DType::INT8: return static_cast<const int8_t*>(p)[i];
    case DType::INT16: return static_cast<const int16_t*>(p)[i];
    case DType::INT32: return static_cast<const int32_t*>(p)[i];
    case DType::INT64: return static_cast<double>(static_cast<const int64_t*>(p)[i]);
    case DType::UINT16: return static_cast<const uint16_t*>(p)[i];
    case DType::FLOAT16: return half_value(static_cast<const uint16_t*>(p)[i]);
    case DType::BFLOAT16: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::FLOAT32: return static_cast<const float*>(p)[i];
    case DType::FLOAT64: return static_cast<const double*>(p)[i];
    case DType::BOOL: return static_cast<const uint8_t*>(p)[i];
  }
  return 0;
}

uint64_t word(DType d, const void* p, size_t i) {
  uint64_t w = 0;
  std::memcpy(&w, static_cast<const char*>(p) + i * itemsize(d), itemsize(d));
  return w;
}

// A deterministic pseudo-random stream (so a failure reproduces).
struct Lcg {
  uint64_t s;
  uint64_t next() {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return s >> 17;
  }
  double uniform() { return static_cast<double>(next() % 1000003) / 1000003.0; }
};

// Test inputs: small integers for integer types (so sums and products stay exact in double), all bit
// patterns for 16-bit floats, moderate magnitudes plus specials for float32/float64.
void fill(DType d, void* p, size_t n, Lcg& rng) {
  for (size_t i = 0; i < n; ++i) {
    const int small = static_cast<int>(rng.next() % 21) - 10;
    const double real = (rng.uniform() - 0.5) * std::ldexp(1.0, static_cast<int>(rng.next() % 20) - 10);
    switch (d) {
      case DType::UINT8: static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(rng.next() % 16); break;
      case DType::UINT16: static_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(rng.next() % 256); break;
      case DType::INT8: static_cast<int8_t*>(p)[i] = static_cast<int8_t>(small); break;
      // Products of two stay in range (and exact in double); int64 sums still carry past 32 bits.
      case DType::INT16: static_cast<int16_t*>(p)[i] = static_cast<int16_t>(small * 10); break;
      case DType::INT32: static_cast<int32_t*>(p)[i] = small * 1000; break;
      case DType::INT64: static_cast<int64_t*>(p)[i] = static_cast<int64_t>(small) * 100000000ll; break;
      case DType::BOOL: static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(rng.next() % 2); break;
      case DType::FLOAT16:
      case DType::BFLOAT16: static_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(rng.next()); break;
      case DType::FLOAT32: static_cast<float*>(p)[i] = static_cast<float>(real); break;
      case DType::FLOAT64: static_cast<double*>(p)[i] = real; break;
    }
  }
  if ((d == DType::FLOAT32 || d == DType::FLOAT64) && n >= 4) {
    const double specials[] = {std::nan(""), INFINITY, -INFINITY, -0.0};
    for (int k = 0; k < 4; ++k) {
      const size_t i = rng.next() % n;
      if (d == DType::FLOAT32) static_cast<float*>(p)[i] = static_cast<float>(specials[k]);
      else static_cast<double*>(p)[i] = specials[k];
    }
  }
}

// The expected result word of a floating-point value x (exact in double) rounded to dtype d.
uint64_t round_to(DType d, double x) {
  switch (d) {
    case DType::FLOAT16: {
      if (std::isnan(x)) return 0x7E00;
      return half_ref(static_cast<float>(x));  // first to float32 (the kernels compute there), then to half
    }
    case DType::BFLOAT16: {
      if (std::isnan(x)) return 0x7FC0;
      return bf16_ref(static_cast<float>(x));
    }
    case DType::FLOAT32: return bits_of(static_cast<float>(x));
    case DType::FLOAT64: {
      uint64_t w;
      std::memcpy(&w, &x, 8);
      return w;
    }
    default: return 0;
  }
}

bool is_float(DType d) {
  return d == DType::FLOAT16 || d == DType::BFLOAT16 || d == DType::FLOAT32 || d == DType::FLOAT64;
}

bool word_is_nan(DType d, uint64_t w) {
  switch (d) {
    case DType::FLOAT16: return is_half_nan(static_cast<uint16_t>(w));
    case DType::BFLOAT16: return is_bf16_nan(static_cast<uint16_t>(w));
    case DType::FLOAT32: return std::isnan(float_of(static_cast<uint32_t>(w)));
    case DType::FLOAT64: {
      double v;
      std::memcpy(&v, &w, 8);
      return std::isnan(v);
    }
    default: return false;
  }
}

// Equal words, or both NaN (payloads are not specified).
bool same(DType d, uint64_t got, uint64_t want) {
  return got == want || (is_float(d) && word_is_nan(d, got) && word_is_nan(d, want));
}

void put_int(DType d, void* p, size_t i, double v) {
  switch (d) {
    case DType::UINT8: static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(v); break;
    case DType::INT8: static_cast<int8_t*>(p)[i] = static_cast<int8_t>(v); break;
    case DType::INT16: static_cast<int16_t*>(p)[i] = static_cast<int16_t>(v); break;
    case DType::INT32: static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v); break;
    case DType::INT64: static_cast<int64_t*>(p)[i] = static_cast<int64_t>(v); break;
    case DType::UINT16: static_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(v); break;
    case DType::BOOL: static_cast<uint8_t*>(p)[i] = v != 0; break;
    default: break;
  }
}

uint64_t expected_scale(DType d, const void* src, size_t i, double factor) {
  const double x = get(d, src, i);
  if (d == DType::BOOL) return word(d, src, i);
  if (is_float(d)) {
    if (d == DType::FLOAT64) return round_to(d, x * factor);
    // float32 arithmetic: the operands are floats, their product is exact in double and rounded once.
    return round_to(d, static_cast<double>(static_cast<float>(x * static_cast<double>(static_cast<float>(factor)))));
  }
  uint64_t w = 0;
  put_int(d, &w, 0, std::trunc(x * factor));
  return w;
}

// NumPy's semantics, in T's arithmetic (float for float32 and the 16-bit floats, double for float64).
template <typename T>
T combine_in(DType d, ReduceOp op, T a, T b) {
  if (d == DType::BOOL) {
    return (op == ReduceOp::MIN || op == ReduceOp::PRODUCT) ? (a != 0 && b != 0) : (a != 0 || b != 0);
  }
  switch (op) {
    case ReduceOp::MIN: return (std::isnan(a) || std::isnan(b)) ? NAN : std::min(a, b);
    case ReduceOp::MAX: return (std::isnan(a) || std::isnan(b)) ? NAN : std::max(a, b);
    case ReduceOp::PRODUCT: return a * b;
    default: return a + b;
  }
}

uint64_t expected_combine(DType d, ReduceOp op, const void* a, const void* b, size_t i) {
  const double x = get(d, a, i), y = get(d, b, i);
  if (is_float(d)) {
    if ((op == ReduceOp::MIN || op == ReduceOp::MAX) && x == 0 && y == 0) {
      return word(d, a, i);  // min(0.0, -0.0): NumPy keeps the first operand
    }
    if (d == DType::FLOAT64) return round_to(d, combine_in<double>(d, op, x, y));
    // One float operation (float32 and the 16-bit floats, which the kernels combine in float32).
    return round_to(d, combine_in<float>(d, op, static_cast<float>(x), static_cast<float>(y)));
  }
  uint64_t w = 0;
  put_int(d, &w, 0, combine_in<double>(d, op, x, y));  // small integers: exact in double
  return w;
}

void test_scale() {
  Lcg rng{42};
  const double factors[] = {1.0, 0.5, 1.0 / 3.0, 0.1, 2.5, -0.75, 1e-3, 1e-7};
  for (DType d : kDTypes) {
    const size_t isz = itemsize(d);
    for (size_t n : {size_t(0), size_t(1), size_t(3), size_t(17), size_t(1031)}) {
      for (double f : factors) {
        if ((d == DType::UINT8 || d == DType::UINT16) && f < 0) continue;
        std::vector<unsigned char> src(n * isz + 1), dst(n * isz + 1, 0xCD), inplace;
        fill(d, src.data(), n, rng);
        inplace = src;
        scale_into(src.data(), dst.data(), n, d, f);
        scale_into(inplace.data(), inplace.data(), n, d, f);
        int bad = 0;
        for (size_t i = 0; i < n && bad < 3; ++i) {
          const uint64_t want = expected_scale(d, src.data(), i, f);
          const uint64_t got = word(d, dst.data(), i), got_in_place = word(d, inplace.data(), i);
          if (!same(d, got, want) || !same(d, got_in_place, want)) {
            ++bad;
            EXPECT(false, "scale_into " << dtype_name(d) << " x" << f << " [" << i << "] of " << get(d, src.data(), i)
                                        << ": " << hex(got) << " (in place " << hex(got_in_place) << "), want "
                                        << hex(want));
          }
        }
        EXPECT(dst[n * isz] == 0xCD, "scale_into wrote past the end");
        ++g_checks;
      }
    }
  }
  // Horovod's truncating integer scaling, including the wrap-around of an out-of-range int8.
  int8_t i8[] = {7, -7, 100, -128};
  scale_into(i8, i8, 4, DType::INT8, 0.5);
  EXPECT(i8[0] == 3 && i8[1] == -3 && i8[2] == 50 && i8[3] == -64, "int8 * 0.5 truncates toward zero");
  int8_t w8[] = {100};
  scale_into(w8, w8, 1, DType::INT8, 2.0);
  EXPECT(w8[0] == -56, "int8 100 * 2 wraps to -56 as on x86, got " << int(w8[0]));
  int64_t i64[] = {INT64_MAX, -5};
  scale_into(i64, i64, 2, DType::INT64, 4.0);
  EXPECT(i64[0] == INT64_MIN && i64[1] == -20, "int64 out of range gives INT64_MIN");
  int32_t nan32[] = {5};
  scale_into(nan32, nan32, 1, DType::INT32, std::nan(""));
  EXPECT(nan32[0] == INT32_MIN, "a NaN factor gives the integer indefinite value");
  // float16: a tiny factor must not underflow before rounding (the product is formed in float32).
  uint16_t h[] = {float_to_half(60000.0f)};
  scale_into(h, h, 1, DType::FLOAT16, 1.0 / 60000.0);
  EXPECT(h[0] == 0x3C00, "60000 * (1/60000) in float16 gave " << hex(h[0]));
}

void test_combine() {
  Lcg rng{7};
  for (DType d : kDTypes) {
    const size_t isz = itemsize(d);
    for (ReduceOp op : kOps) {
      for (size_t n : {size_t(0), size_t(1), size_t(5), size_t(33), size_t(2053)}) {
        std::vector<unsigned char> a(n * isz + 1), b(n * isz + 1), out(n * isz + 1, 0xCD);
        fill(d, a.data(), n, rng);
        fill(d, b.data(), n, rng);
        std::vector<unsigned char> alias_a = a, alias_b = b;
        combine(a.data(), b.data(), out.data(), n, d, op);
        combine(alias_a.data(), b.data(), alias_a.data(), n, d, op);
        combine(a.data(), alias_b.data(), alias_b.data(), n, d, op);
        int bad = 0;
        for (size_t i = 0; i < n && bad < 3; ++i) {
          const uint64_t want = expected_combine(d, op, a.data(), b.data(), i);
          const uint64_t got = word(d, out.data(), i);
          const uint64_t got_a = word(d, alias_a.data(), i), got_b = word(d, alias_b.data(), i);
          if (!same(d, got, want) || !same(d, got_a, want) || !same(d, got_b, want)) {
            ++bad;
            EXPECT(false, "combine " << dtype_name(d) << " " << reduce_op_title(op) << " [" << i << "] "
                                     << get(d, a.data(), i) << ", " << get(d, b.data(), i) << ": " << hex(got)
                                     << " (aliased " << hex(got_a) << ", " << hex(got_b) << "), want " << hex(want));
          }
        }
        EXPECT(out[n * isz] == 0xCD, "combine wrote past the end");
      }
    }
  }
  // Integer sums and products wrap around, as NumPy's do.
  int8_t a8[] = {100, -128}, b8[] = {100, -1}, o8[2];
  combine(a8, b8, o8, 2, DType::INT8, ReduceOp::SUM);
  EXPECT(o8[0] == -56 && o8[1] == 127, "int8 sums wrap");
  uint16_t a16[] = {65535}, b16[] = {65535}, o16[1];
  combine(a16, b16, o16, 1, DType::UINT16, ReduceOp::PRODUCT);
  EXPECT(o16[0] == 1, "uint16 products wrap, got " << o16[0]);
  int64_t a64[] = {INT64_MAX}, b64[] = {1}, o64[1];
  combine(a64, b64, o64, 1, DType::INT64, ReduceOp::SUM);
  EXPECT(o64[0] == INT64_MIN, "int64 sums wrap");
  // bool: any non-zero byte is true, results are 0 or 1.
  uint8_t ba[] = {0, 2, 0, 5}, bb[] = {0, 0, 3, 1}, bo[4];
  combine(ba, bb, bo, 4, DType::BOOL, ReduceOp::SUM);
  EXPECT(bo[0] == 0 && bo[1] == 1 && bo[2] == 1 && bo[3] == 1, "bool SUM is OR");
  combine(ba, bb, bo, 4, DType::BOOL, ReduceOp::PRODUCT);
  EXPECT(bo[0] == 0 && bo[1] == 0 && bo[2] == 0 && bo[3] == 1, "bool PRODUCT is AND");
  bool threw = false;
  try {
    combine(ba, bb, bo, 4, DType::FLOAT32, ReduceOp::ADASUM);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  EXPECT(threw, "combine rejects Adasum");
}

// -- repr helpers --------------------------------------------------------------------------------------

// combine_scaled: combine then scale, bit for bit, except that a 16-bit float sum is scaled in float32 and
// rounded once.
void test_combine_scaled() {
  Lcg rng{11};
  for (DType d : kDTypes) {
    const size_t isz = itemsize(d);
    for (ReduceOp op : kOps) {
      for (double f : {1.0, 0.5, 1.0 / 3.0}) {
        const size_t n = 517;
        std::vector<unsigned char> a(n * isz), b(n * isz), out(n * isz + 1, 0xCD), two(n * isz), alias = a;
        fill(d, a.data(), n, rng);
        fill(d, b.data(), n, rng);
        alias = a;
        combine_scaled(a.data(), b.data(), out.data(), n, d, op, f);
        combine_scaled(alias.data(), b.data(), alias.data(), n, d, op, f);
        combine(a.data(), b.data(), two.data(), n, d, op);
        scale_into(two.data(), two.data(), n, d, f);
        const bool once = (d == DType::FLOAT16 || d == DType::BFLOAT16) && f != 1.0 &&
                          (op == ReduceOp::SUM || op == ReduceOp::AVERAGE);
        int bad = 0;
        for (size_t i = 0; i < n && bad < 3; ++i) {
          uint64_t want = word(d, two.data(), i);
          if (once) {
            const uint16_t x = static_cast<const uint16_t*>(static_cast<const void*>(a.data()))[i];
            const uint16_t y = static_cast<const uint16_t*>(static_cast<const void*>(b.data()))[i];
            const float wx = d == DType::FLOAT16 ? half_to_float(x) : bf16_to_float(x);
            const float wy = d == DType::FLOAT16 ? half_to_float(y) : bf16_to_float(y);
            want = round_to(d, static_cast<double>((wx + wy) * static_cast<float>(f)));
          }
          const uint64_t got = word(d, out.data(), i), got_alias = word(d, alias.data(), i);
          if (!same(d, got, want) || !same(d, got_alias, want)) {
            ++bad;
            EXPECT(false, "combine_scaled " << dtype_name(d) << " " << reduce_op_title(op) << " x" << f << " [" << i
                                            << "]: " << hex(got) << " (aliased " << hex(got_alias) << "), want "
                                            << hex(want));
          }
        }
        EXPECT(out[n * isz] == 0xCD, "combine_scaled wrote past the end");
      }
    }
  }
}

void test_repr_known() {
  const std::pair<std::string, std::string> strings[] = {
      {"", "''"},
      {"abc", "'abc'"},
      {"it's", "\"it's\""},
      {"say \"hi\"", "'say \"hi\"'"},
      {"both ' and \"", "'both \\' and \"'"},
      {"back\\slash", "'back\\\\slash'"},
      {"t\tn\nr\r", "'t\\tn\\nr\\r'"},
      {std::string("\x00\x01\x1f\x7f", 4), "'\\x00\\x01\\x1f\\x7f'"},
      {"\xc3\xa9\xe4\xb8\xad\xf0\x9f\x99\x82", "'\xc3\xa9\xe4\xb8\xad\xf0\x9f\x99\x82'"},  // é中🙂 kept
      {"\xc2\x80\xc2\xa0\xc2\xad", "'\\x80\\xa0\\xad'"},
      {"\xe2\x80\xa8\xef\xbb\xbf", "'\\u2028\\ufeff'"},
      {"\xf3\xa0\x80\x81", "'\\U000e0001'"},
      {"bad\xff", "'bad\\udcff'"},  // invalid UTF-8, as surrogateescape decodes it
  };
  for (const auto& c : strings) {
    const std::string got = py_repr(c.first);
    EXPECT(got == c.second, "py_repr(string) = " << got << ", want " << c.second);
  }
  const std::pair<double, const char*> doubles[] = {
      {1.0, "1.0"},       {0.5, "0.5"},         {0.1, "0.1"},        {-0.0, "-0.0"},
      {0.0, "0.0"},       {1e16, "1e+16"},      {1e15, "1000000000000000.0"},
      {1e-5, "1e-05"},    {1e-4, "0.0001"},     {123.456, "123.456"}, {1.5e300, "1.5e+300"},
      {5e-324, "5e-324"}, {INFINITY, "inf"},    {-INFINITY, "-inf"},  {NAN, "nan"},
      {0.1 + 0.2, "0.30000000000000004"},      {1.0 / 3.0, "0.3333333333333333"},
      {-2.5e-7, "-2.5e-07"},
      // powers of two, where the nearest decimal of a length may not read back but its upper neighbour does
      {0x1p-24, "5.960464477539063e-08"}, {-0x1p-1017, "-7.120236347223045e-307"},
      {0x1p976, "6.386688990511104e+293"},
  };
  for (const auto& c : doubles) {
    const std::string got = py_repr(c.first);
    EXPECT(got == c.second, "py_repr(double) = " << got << ", want " << c.second);
  }
  EXPECT(py_repr(std::vector<int64_t>{}) == "()", py_repr(std::vector<int64_t>{}));
  EXPECT(py_repr(std::vector<int64_t>{5}) == "(5,)", py_repr(std::vector<int64_t>{5}));
  EXPECT(py_repr(std::vector<int64_t>{2, 3}) == "(2, 3)", py_repr(std::vector<int64_t>{2, 3}));
  EXPECT(py_list({}) == "[]", py_list({}));
  EXPECT(py_list({0, 2}) == "[0, 2]", py_list({0, 2}));

  EXPECT(std::string(dtype_name(DType::BFLOAT16)) == "bfloat16", dtype_name(DType::BFLOAT16));
  EXPECT(std::string(dtype_name(DType::BOOL)) == "bool", dtype_name(DType::BOOL));
  EXPECT(std::string(dtype_name(DType::UINT16)) == "uint16", dtype_name(DType::UINT16));
  EXPECT(std::string(op_name(OpType::REDUCESCATTER)) == "reducescatter", op_name(OpType::REDUCESCATTER));
  EXPECT(std::string(op_name(OpType::BARRIER)) == "barrier", op_name(OpType::BARRIER));
  EXPECT(std::string(reduce_op_title(ReduceOp::AVERAGE)) == "Average", reduce_op_title(ReduceOp::AVERAGE));
  EXPECT(std::string(reduce_op_title(ReduceOp::PRODUCT)) == "Product", reduce_op_title(ReduceOp::PRODUCT));
}

// -- NumPy's answers -----------------------------------------------------------------------------------

struct Reader {
  std::vector<char> data;
  size_t pos = 0;
  bool more() const { return pos < data.size(); }
  template <typename T>
  T read() {
    T v;
    std::memcpy(&v, take(sizeof v), sizeof v);
    return v;
  }
  const char* take(size_t n) {
    if (pos + n > data.size()) throw std::runtime_error("the reference file is truncated");
    const char* p = data.data() + pos;
    pos += n;
    return p;
  }
  std::string blob() {
    const uint64_t n = read<uint64_t>();
    return std::string(take(n), n);
  }
};

int compare_words(DType d, const char* got, const char* want, size_t n, const std::string& what, bool zero_sign_free) {
  int bad = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint64_t g = word(d, got, i), w = word(d, want, i);
    bool ok = same(d, g, w);
    if (!ok && zero_sign_free && is_float(d) && get(d, got, i) == 0 && get(d, want, i) == 0) ok = true;
    if (!ok) {
      if (++bad <= 3) EXPECT(false, what << " [" << i << "]: " << hex(g) << ", NumPy says " << hex(w));
    } else {
      ++g_checks;
    }
  }
  return bad;
}

void test_against_numpy(const char* path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    EXPECT(false, "cannot read " << path);
    return;
  }
  Reader r;
  r.data.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  int records = 0;
  while (r.more()) {
    const int32_t kind = r.read<int32_t>();
    const DType d = static_cast<DType>(r.read<int32_t>());
    const ReduceOp op = static_cast<ReduceOp>(r.read<int32_t>());
    r.read<int32_t>();
    const double factor = r.read<double>();
    const uint64_t n = r.read<uint64_t>();
    ++records;
    switch (kind) {
      case 1: {  // scale_into
        const size_t bytes = n * itemsize(d);
        const char* src = r.take(bytes);
        const char* want = r.take(bytes);
        std::vector<char> got(bytes + 1);
        scale_into(src, got.data(), n, d, factor);
        compare_words(d, got.data(), want, n,
                      std::string("scale_into ") + dtype_name(d) + " x" + py_repr(factor), false);
        std::vector<char> inplace(src, src + bytes);
        scale_into(inplace.data(), inplace.data(), n, d, factor);
        compare_words(d, inplace.data(), want, n,
                      std::string("in-place scale_into ") + dtype_name(d) + " x" + py_repr(factor), false);
        break;
      }
      case 2: {  // combine
        const size_t bytes = n * itemsize(d);
        const char* a = r.take(bytes);
        const char* b = r.take(bytes);
        const char* want = r.take(bytes);
        std::vector<char> got(bytes + 1);
        combine(a, b, got.data(), n, d, op);
        const bool minmax = op == ReduceOp::MIN || op == ReduceOp::MAX;  // NumPy's SIMD loops pick either zero
        compare_words(d, got.data(), want, n,
                      std::string("combine ") + dtype_name(d) + " " + reduce_op_title(op), minmax);
        break;
      }
      case 3: {  // half -> float
        const char* in = r.take(n * 2);
        const char* want = r.take(n * 4);
        std::vector<float> got(n);
        for (size_t i = 0; i < n; ++i) {
          uint16_t h;
          std::memcpy(&h, in + 2 * i, 2);
          got[i] = half_to_float(h);
        }
        compare_words(DType::FLOAT32, reinterpret_cast<const char*>(got.data()), want, n, "half_to_float", false);
        break;
      }
      case 4:    // float -> half
      case 5: {  // float -> bfloat16
        const char* in = r.take(n * 4);
        const char* want = r.take(n * 2);
        std::vector<uint16_t> got(n);
        for (size_t i = 0; i < n; ++i) {
          float v;
          std::memcpy(&v, in + 4 * i, 4);
          got[i] = kind == 4 ? float_to_half(v) : float_to_bf16(v);
        }
        compare_words(kind == 4 ? DType::FLOAT16 : DType::BFLOAT16, reinterpret_cast<const char*>(got.data()),
                      want, n, kind == 4 ? "float_to_half" : "float_to_bf16", false);
        break;
      }
      case 6: {  // repr(str)
        const std::string in(r.take(n), n);
        const std::string want = r.blob();
        const std::string got = py_repr(in);
        EXPECT(got == want, "py_repr(string) = " << got << ", Python says " << want);
        break;
      }
      case 7: {  // repr(float)
        const std::string want = r.blob();
        const std::string got = py_repr(factor);
        EXPECT(got == want, "py_repr(double) = " << got << ", Python says " << want);
        break;
      }
      case 8: {  // repr(tuple of int)
        std::vector<int64_t> t(n);
        for (auto& v : t) v = r.read<int64_t>();
        const std::string want = r.blob();
        EXPECT(py_repr(t) == want, "py_repr(tuple) = " << py_repr(t) << ", Python says " << want);
        break;
      }
      case 9: {  // repr(list of int)
        std::vector<int> v(n);
        for (auto& x : v) x = r.read<int32_t>();
        const std::string want = r.blob();
        EXPECT(py_list(v) == want, "py_list = " << py_list(v) << ", Python says " << want);
        break;
      }
      default:
        EXPECT(false, "unknown record kind " << kind << " in " << path);
        return;
    }
  }
  std::printf("test_kernels: %d NumPy/Python reference records compared\n", records);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    test_half_to_float();
    test_float_to_half();
    test_bf16();
    test_scale();
    test_combine();
    test_combine_scaled();
    test_repr_known();
    if (argc > 1) test_against_numpy(argv[1]);
  } catch (const std::exception& e) {
    fail(__LINE__, std::string("exception: ") + e.what());
  }
  if (g_failures) {
    std::fprintf(stderr, "test_kernels: %d of %d checks FAILED\n", g_failures, g_checks);
    return 1;
  }
  std::printf("test_kernels: all %d checks passed\n", g_checks);
  return 0;
}
