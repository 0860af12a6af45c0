// Element-wise kernels. Every loop is a plain typed loop with branch-free bodies so that GCC and Clang
// vectorise it at -O3 for baseline x86-64 (SSE2): no intrinsics, no -march flags. The semantics follow
// perseus/transport/kernels.py, which they replace: NumPy's arithmetic, Horovod's integer scaling.
#include "kernels.h"

#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

// The 16-bit float loops are bit manipulation that baseline x86-64 (SSE2) vectorises poorly (about 2 ns an
// element, against 0.3 ns with AVX-512). Where the toolchain supports it they are also compiled for newer
// CPUs and the loader picks the variant this CPU can run (GNU ifunc): no intrinsics, no -march, and the
// library still runs on any x86-64. Build with -DPERSEUS_NO_TARGET_CLONES for the plain loops only.
#if defined(__x86_64__) && defined(__linux__) && defined(__has_attribute) && !defined(PERSEUS_NO_TARGET_CLONES)
#if __has_attribute(target_clones)
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define PERSEUS_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define PERSEUS_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#endif
#ifndef PERSEUS_CLONES
#define PERSEUS_CLONES
#endif

namespace perseus {
namespace {

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

// A branch-free select. GCC keeps `c ? a : b` as a branch when one side comes from floating-point
// arithmetic (which may trap), and a branch stops vectorisation; the mask form is plain integer logic.
inline uint32_t select(bool c, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(c);
  return (a & mask) | (b & ~mask);
}

inline float h2f(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7FFFu;  // exponent and mantissa
  // Normal numbers, inf and NaN: shift into float position and rebias the exponent (15 -> 127); the
  // all-ones exponent 31 must become 255, so it gets a larger bias. NaN payloads are kept.
  const uint32_t bias = em >= 0x7C00u ? (224u << 23) : (112u << 23);
  const uint32_t normal = (em << 13) + bias;
  // Zero and subnormals are m * 2^-24, computed from the integer m so that no denormal float takes part
  // (a process running with denormals-are-zero would read one as 0).
  const uint32_t sub = bits_of(static_cast<float>(static_cast<int32_t>(em)) * 5.9604644775390625e-08f);
  return float_of(select(em < 0x0400u, sub, normal) | sign);
}

inline uint16_t f2h(float f) {
  const uint32_t bits = bits_of(f);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t a = bits & 0x7FFFFFFFu;
  // Normal halves: rebias (127 -> 15) and drop 13 mantissa bits, rounding to nearest even; a carry out of
  // the mantissa correctly bumps the exponent, up to infinity for 65520 <= |f| < 65536.
  const uint32_t normal = (a - (112u << 23) + 0x0FFFu + ((a >> 13) & 1u)) >> 13;
  // Subnormal halves: |f| + 0.5 has a unit in the last place of 2^-24, so the addition itself rounds |f|
  // to nearest even at the half's subnormal resolution; the low bits are then the half's mantissa (1024
  // is the smallest normal half, which the encoding gets right too).
  const uint32_t sub = bits_of(float_of(a) + 0.5f) - 0x3F000000u;
  const uint32_t nan = 0x7E00u | ((a >> 13) & 0x03FFu);  // quiet NaN, top payload bits kept
  uint32_t h = select(a < 0x38800000u, sub, normal);  // 0x38800000 = 2^-14, the smallest normal half
  h = select(a >= 0x47800000u, 0x7C00u, h);           // |f| >= 65536 (and inf): infinity
  h = select(a > 0x7F800000u, nan, h);
  return static_cast<uint16_t>(h | sign);
}

inline uint16_t f2bf(float f) {
  const uint32_t bits = bits_of(f);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;  // nearest, ties to even
  const uint32_t nan = (bits >> 16) | 0x40u;  // truncating a NaN could leave inf: force the quiet bit
  return static_cast<uint16_t>(select((bits & 0x7FFFFFFFu) > 0x7F800000u, nan, rounded));
}

inline float bf2f(uint16_t b) { return float_of(static_cast<uint32_t>(b) << 16); }

// double -> integer as x86's truncating conversions do, which is what Horovod's and NumPy's casts produce
// there: toward zero, and the "integer indefinite" value (the most negative int) when out of range or NaN.
// Types narrower than 32 bits go through int32 and keep its low bits. Written out because a plain C++
// cast is undefined out of range.
template <typename T>
inline T to_int(double v) {
  if constexpr (sizeof(T) == 8) {
    const bool ok = v >= -9223372036854775808.0 && v < 9223372036854775808.0;
    return static_cast<T>(ok ? static_cast<int64_t>(v) : INT64_MIN);
  } else {
    const bool ok = v > -2147483649.0 && v < 2147483648.0;
    const int32_t i = ok ? static_cast<int32_t>(v) : INT32_MIN;
    return static_cast<T>(static_cast<uint32_t>(i));  // modulo 2^bits, defined for unsigned
  }
}

// -- scale ---------------------------------------------------------------------------------------------

template <typename T>
void scale_float(const T* src, T* dst, size_t n, T factor) {
  for (size_t i = 0; i < n; ++i) dst[i] = src[i] * factor;
}

template <typename T>
void scale_int(const T* src, T* dst, size_t n, double factor) {
  for (size_t i = 0; i < n; ++i) dst[i] = to_int<T>(static_cast<double>(src[i]) * factor);
}

PERSEUS_CLONES void scale_half(const uint16_t* src, uint16_t* dst, size_t n, float factor) {
  for (size_t i = 0; i < n; ++i) dst[i] = f2h(h2f(src[i]) * factor);
}

PERSEUS_CLONES void scale_bf16(const uint16_t* src, uint16_t* dst, size_t n, float factor) {
  for (size_t i = 0; i < n; ++i) dst[i] = f2bf(bf2f(src[i]) * factor);
}

// -- combine -------------------------------------------------------------------------------------------

enum class Kind { SUM, MIN, MAX, PRODUCT };

Kind kind_of(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM:
    case ReduceOp::AVERAGE:
      return Kind::SUM;
    case ReduceOp::MIN:
      return Kind::MIN;
    case ReduceOp::MAX:
      return Kind::MAX;
    case ReduceOp::PRODUCT:
      return Kind::PRODUCT;
    default:
      throw std::invalid_argument(std::string("combine: no element-wise form for reduction ") +
                                  reduce_op_title(op));
  }
}

// Floating point min/max as NumPy's minimum/maximum: a NaN in either operand gives NaN.
template <typename T>
inline T fmin_nan(T a, T b) {
  return (a <= b || a != a) ? a : b;
}
template <typename T>
inline T fmax_nan(T a, T b) {
  return (a >= b || a != a) ? a : b;
}

#if defined(__GNUC__)
#define PERSEUS_INLINE inline __attribute__((always_inline))  // so that the loop lands in each clone
#else
#define PERSEUS_INLINE inline
#endif

template <typename T, typename F>
PERSEUS_INLINE void zip(const T* a, const T* b, T* out, size_t n, F f) {
  for (size_t i = 0; i < n; ++i) out[i] = f(a[i], b[i]);
}

template <typename T>
void combine_float(const T* a, const T* b, T* out, size_t n, Kind k) {
  switch (k) {
    case Kind::SUM: return zip(a, b, out, n, [](T x, T y) { return x + y; });
    case Kind::PRODUCT: return zip(a, b, out, n, [](T x, T y) { return x * y; });
    case Kind::MIN: return zip(a, b, out, n, [](T x, T y) { return fmin_nan(x, y); });
    case Kind::MAX: return zip(a, b, out, n, [](T x, T y) { return fmax_nan(x, y); });
  }
}

template <typename T>
void combine_int(const T* a, const T* b, T* out, size_t n, Kind k) {
  // Sums and products wrap around as NumPy's do; computing them in the promoted unsigned type keeps that
  // defined (signed overflow, and uint16 * uint16 promoted to int, would be undefined).
  using W = std::make_unsigned_t<decltype(T() + T())>;
  switch (k) {
    case Kind::SUM: return zip(a, b, out, n, [](T x, T y) { return static_cast<T>(W(x) + W(y)); });
    case Kind::PRODUCT: return zip(a, b, out, n, [](T x, T y) { return static_cast<T>(W(x) * W(y)); });
    case Kind::MIN: return zip(a, b, out, n, [](T x, T y) { return y < x ? y : x; });
    case Kind::MAX: return zip(a, b, out, n, [](T x, T y) { return x < y ? y : x; });
  }
}

// 16-bit floats: widen both operands, combine in float32, round once.
template <float (*Widen)(uint16_t), uint16_t (*Narrow)(float)>
PERSEUS_INLINE void combine_16(const uint16_t* a, const uint16_t* b, uint16_t* out, size_t n, Kind k) {
  switch (k) {
    case Kind::SUM:
      return zip(a, b, out, n, [](uint16_t x, uint16_t y) { return Narrow(Widen(x) + Widen(y)); });
    case Kind::PRODUCT:
      return zip(a, b, out, n, [](uint16_t x, uint16_t y) { return Narrow(Widen(x) * Widen(y)); });
    case Kind::MIN:
      return zip(a, b, out, n, [](uint16_t x, uint16_t y) { return Narrow(fmin_nan(Widen(x), Widen(y))); });
    case Kind::MAX:
      return zip(a, b, out, n, [](uint16_t x, uint16_t y) { return Narrow(fmax_nan(Widen(x), Widen(y))); });
  }
}

// Non-template entry points, since target_clones applies to plain functions (the loops inline into each).
PERSEUS_CLONES void combine_half(const uint16_t* a, const uint16_t* b, uint16_t* out, size_t n, Kind k) {
  combine_16<h2f, f2h>(a, b, out, n, k);
}
PERSEUS_CLONES void combine_bf16(const uint16_t* a, const uint16_t* b, uint16_t* out, size_t n, Kind k) {
  combine_16<bf2f, f2bf>(a, b, out, n, k);
}

// Sum and scale in one pass.
template <typename T>
void sum_scaled_float(const T* a, const T* b, T* out, size_t n, T factor) {
  zip(a, b, out, n, [factor](T x, T y) { return (x + y) * factor; });
}
PERSEUS_CLONES void sum_scaled_half(const uint16_t* a, const uint16_t* b, uint16_t* out, size_t n, float factor) {
  zip(a, b, out, n, [factor](uint16_t x, uint16_t y) { return f2h((h2f(x) + h2f(y)) * factor); });
}
PERSEUS_CLONES void sum_scaled_bf16(const uint16_t* a, const uint16_t* b, uint16_t* out, size_t n, float factor) {
  zip(a, b, out, n, [factor](uint16_t x, uint16_t y) { return f2bf((bf2f(x) + bf2f(y)) * factor); });
}

void combine_bool(const uint8_t* a, const uint8_t* b, uint8_t* out, size_t n, Kind k) {
  if (k == Kind::SUM || k == Kind::MAX) {
    zip(a, b, out, n, [](uint8_t x, uint8_t y) { return static_cast<uint8_t>((x | y) != 0); });
  } else {
    zip(a, b, out, n, [](uint8_t x, uint8_t y) { return static_cast<uint8_t>((x != 0) & (y != 0)); });
  }
}

[[noreturn]] void bad_dtype(const char* what, DType dtype) {
  throw std::invalid_argument(std::string(what) + ": unknown dtype " +
                              std::to_string(static_cast<int>(dtype)));
}

}  // namespace

float half_to_float(uint16_t h) { return h2f(h); }
uint16_t float_to_half(float f) { return f2h(f); }
uint16_t float_to_bf16(float f) { return f2bf(f); }

void scale_into(const void* src, void* dst, size_t count, DType dtype, double factor) {
#define PERSEUS_INT(T) scale_int(static_cast<const T*>(src), static_cast<T*>(dst), count, factor)
  switch (dtype) {
    case DType::UINT8: return PERSEUS_INT(uint8_t);
    case DType::INT8: return PERSEUS_INT(int8_t);
    case DType::INT16: return PERSEUS_INT(int16_t);
    case DType::INT32: return PERSEUS_INT(int32_t);
    case DType::INT64: return PERSEUS_INT(int64_t);
    case DType::UINT16: return PERSEUS_INT(uint16_t);
    case DType::FLOAT16:
      return scale_half(static_cast<const uint16_t*>(src), static_cast<uint16_t*>(dst), count,
                        static_cast<float>(factor));
    case DType::BFLOAT16:
      return scale_bf16(static_cast<const uint16_t*>(src), static_cast<uint16_t*>(dst), count,
                        static_cast<float>(factor));
    case DType::FLOAT32:  // as NumPy multiplies a float32 array by a Python float: in float32
      return scale_float(static_cast<const float*>(src), static_cast<float*>(dst), count,
                         static_cast<float>(factor));
    case DType::FLOAT64:
      return scale_float(static_cast<const double*>(src), static_cast<double*>(dst), count, factor);
    case DType::BOOL:
      if (src != dst && count) std::memmove(dst, src, count);
      return;
  }
#undef PERSEUS_INT
  bad_dtype("scale_into", dtype);
}

void combine(const void* a, const void* b, void* out, size_t count, DType dtype, ReduceOp op) {
  const Kind k = kind_of(op);
#define PERSEUS_ARGS(T) static_cast<const T*>(a), static_cast<const T*>(b), static_cast<T*>(out), count, k
  switch (dtype) {
    case DType::UINT8: return combine_int(PERSEUS_ARGS(uint8_t));
    case DType::INT8: return combine_int(PERSEUS_ARGS(int8_t));
    case DType::INT16: return combine_int(PERSEUS_ARGS(int16_t));
    case DType::INT32: return combine_int(PERSEUS_ARGS(int32_t));
    case DType::INT64: return combine_int(PERSEUS_ARGS(int64_t));
    case DType::UINT16: return combine_int(PERSEUS_ARGS(uint16_t));
    case DType::FLOAT16: return combine_half(PERSEUS_ARGS(uint16_t));
    case DType::BFLOAT16: return combine_bf16(PERSEUS_ARGS(uint16_t));
    case DType::FLOAT32: return combine_float(PERSEUS_ARGS(float));
    case DType::FLOAT64: return combine_float(PERSEUS_ARGS(double));
    case DType::BOOL: return combine_bool(PERSEUS_ARGS(uint8_t));
  }
#undef PERSEUS_ARGS
  bad_dtype("combine", dtype);
}

void combine_scaled(const void* a, const void* b, void* out, size_t count, DType dtype, ReduceOp op,
                    double factor) {
  if (factor != 1.0 && kind_of(op) == Kind::SUM) {
#define PERSEUS_ARGS(T) static_cast<const T*>(a), static_cast<const T*>(b), static_cast<T*>(out), count
    switch (dtype) {
      case DType::FLOAT32: return sum_scaled_float(PERSEUS_ARGS(float), static_cast<float>(factor));
      case DType::FLOAT64: return sum_scaled_float(PERSEUS_ARGS(double), factor);
      case DType::FLOAT16: return sum_scaled_half(PERSEUS_ARGS(uint16_t), static_cast<float>(factor));
      case DType::BFLOAT16: return sum_scaled_bf16(PERSEUS_ARGS(uint16_t), static_cast<float>(factor));
      default: break;
    }
#undef PERSEUS_ARGS
  }
  combine(a, b, out, count, dtype, op);
  if (factor != 1.0) scale_into(out, out, count, dtype, factor);
}

}  // namespace perseus
