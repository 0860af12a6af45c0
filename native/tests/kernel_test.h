// What the kernel test programs share (kernels.cc and common.cc, single-threaded): the check (EXPECT counts a
// check and reports a failure with its file and line, the first 40 of them, and carries on), bit access to
// floats, references for the 16-bit float conversions written independently of kernels.cc (decoding and
// rounding with ldexp/nearbyint in double), element access and seeded test inputs for every dtype, the
// expected result word of a value rounded to a dtype, and each program's summary line.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <sstream>
#include <string>

#include "../common.h"
#include "../kernels.h"

namespace perseus::kernel_test {

inline int g_checks = 0;
inline int g_failures = 0;

inline void fail(const char* file, int line, const std::string& what) {
  ++g_failures;
  if (g_failures <= 40) std::fprintf(stderr, "%s:%d: FAILED: %s\n", file, line, what.c_str());
  if (g_failures == 40) std::fprintf(stderr, "(further failures not shown)\n");
}

#define EXPECT(cond, msg)                                          \
  do {                                                             \
    ++::perseus::kernel_test::g_checks;                            \
    if (!(cond)) {                                                 \
      std::ostringstream os_;                                      \
      os_ << #cond << ": " << msg;                                 \
      ::perseus::kernel_test::fail(__FILE__, __LINE__, os_.str()); \
    }                                                              \
  } while (0)

inline std::string hex(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// -- references, written independently of kernels.cc: decode and round with ldexp/nearbyint in double --

inline double half_value(uint16_t h) {
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
inline uint16_t half_ref(double v) {
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
inline uint16_t bf16_ref(float f) {
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

inline bool is_half_nan(uint16_t h) { return (h & 0x7C00) == 0x7C00 && (h & 0x3FF); }
inline bool is_bf16_nan(uint16_t b) { return (b & 0x7F80) == 0x7F80 && (b & 0x7F); }

// -- dtypes, test inputs and expected words ------------------------------------------------------------

inline constexpr DType kDTypes[] = {DType::UINT8,   DType::INT8,    DType::INT16,   DType::INT32,
                                    DType::INT64,   DType::FLOAT16, DType::BFLOAT16, DType::FLOAT32,
                                    DType::FLOAT64, DType::BOOL,    DType::UINT16};
inline constexpr ReduceOp kOps[] = {ReduceOp::SUM, ReduceOp::MIN, ReduceOp::MAX, ReduceOp::PRODUCT, ReduceOp::AVERAGE};

// Element i of a buffer as a double, and the reverse (exact for the values these tests use).
inline double get(DType d, const void* p, size_t i) {
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

inline uint64_t word(DType d, const void* p, size_t i) {
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
inline void fill(DType d, void* p, size_t n, Lcg& rng) {
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
inline uint64_t round_to(DType d, double x) {
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

inline bool is_float(DType d) {
  return d == DType::FLOAT16 || d == DType::BFLOAT16 || d == DType::FLOAT32 || d == DType::FLOAT64;
}

inline bool word_is_nan(DType d, uint64_t w) {
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
inline bool same(DType d, uint64_t got, uint64_t want) {
  return got == want || (is_float(d) && word_is_nan(d, got) && word_is_nan(d, want));
}

// Runs a program's tests (an exception is a failure too) and prints its summary line. Returns the exit status:
// 1 if any check failed.
inline int run_and_summarise(const char* program, const std::function<void()>& tests) {
  try {
    tests();
  } catch (const std::exception& e) {
    fail(__FILE__, __LINE__, std::string("exception: ") + e.what());
  }
  if (g_failures) {
    std::fprintf(stderr, "%s: %d of %d checks FAILED\n", program, g_failures, g_checks);
    return 1;
  }
  std::printf("%s: all %d checks passed\n", program, g_checks);
  return 0;
}

}  // namespace perseus::kernel_test
