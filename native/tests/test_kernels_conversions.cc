// The 16-bit float conversions of kernels.cc against references computed in double: every float16 to float,
// float to float16 over a sweep of float bit patterns (every half round-tripping, ties to even, overflow,
// subnormals, signed zero, NaNs kept quiet with their sign and payload), and bfloat16 both ways (ties to
// even, NaNs that would truncate to infinity).
// Exits 1 on any failure; run_native_tests.sh runs it built as debug code (-O1) and as shipped (-O3).
#include "kernel_test.h"

using namespace perseus;
using namespace perseus::kernel_test;

namespace {

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

}  // namespace

int main() {
  return run_and_summarise("test_kernels_conversions", [] {
    test_half_to_float();
    test_float_to_half();
    test_bf16();
  });
}
