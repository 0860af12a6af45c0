// The element-wise kernels of kernels.cc against references computed in double, on every dtype and reduction:
// scale_into (out of place and in place, Horovod's truncating and wrapping integer scaling, a float16
// product formed in float32), combine (out of place and aliased either way, NumPy's semantics: integer
// wrap-around, bool as OR and AND, NaN propagation, Adasum refused) and combine_scaled (combine then scale,
// a 16-bit float sum scaled in float32 and rounded once).
// Exits 1 on any failure; run_native_tests.sh runs it built as debug code (-O1) and as shipped (-O3).
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "kernel_test.h"

using namespace perseus;
using namespace perseus::kernel_test;

namespace {

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

}  // namespace

int main() {
  return run_and_summarise("test_kernels_elementwise", [] {
    test_scale();
    test_combine();
    test_combine_scaled();
  });
}
