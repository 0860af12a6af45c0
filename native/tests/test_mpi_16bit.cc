// The MPI transport's 16-bit floats (float16 and bfloat16, reduced through user-defined MPI operations in
// float32): sums of random values, rounded once per combine, with NaN and infinity passed through; on
// MPI_COMM_WORLD and its halves split by parity.
// Run under mpirun with 2 or more ranks (run_native_tests.sh runs 2 and 3); every rank checks its own results,
// and the job exits 1 if any rank saw a failure.
#include <mpi.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "mpi_test.h"

using namespace perseus;
using namespace perseus::mpi_test;

namespace {

// 16-bit float sums of random values: each pairwise combine happens in float32 and is rounded once, so
// on 2 ranks the result is exactly float32(a + b) rounded once; on more ranks the order of the combines is
// MPI's choice, and the result stays within one rounding per combine of the exact sum.
void test_16bit_random_sums(Comm& c) {
  const int size = c.size(), rank = c.rank();
  const size_t n = 50000;
  for (DType d : {DType::FLOAT16, DType::BFLOAT16}) {
    auto value = [&](int r, size_t i) {
      uint64_t s = (static_cast<uint64_t>(r) << 32) ^ (i * 0x9E3779B97F4A7C15ull);
      s ^= s >> 29;
      s *= 0xBF58476D1CE4E5B9ull;
      s ^= s >> 32;
      const double u = static_cast<double>(s % 2000001) / 1000000.0 - 1.0;  // [-1, 1]
      const double scale = std::ldexp(1.0, static_cast<int>((s >> 40) % 16) - 8);
      const float f = static_cast<float>(u * scale);
      return d == DType::FLOAT16 ? float_to_half(f) : float_to_bf16(f);
    };
    auto widen = [&](uint16_t w) { return d == DType::FLOAT16 ? half_to_float(w) : bf16_to_float(w); };
    std::vector<uint16_t> in(n), out(n);
    for (size_t i = 0; i < n; ++i) in[i] = value(rank, i);
    in[0] = rank == 0 ? (d == DType::FLOAT16 ? 0x7E00 : 0x7FC0) : in[0];  // a NaN anywhere gives NaN
    in[1] = rank == size - 1 ? (d == DType::FLOAT16 ? 0x7C00 : 0x7F80) : in[1];  // +inf
    c.allreduce(in.data(), out.data(), n, d, ReduceOp::SUM);
    EXPECT(std::isnan(widen(out[0])), dtype_name(d) << " NaN + x = " << widen(out[0]));
    EXPECT(std::isinf(widen(out[1])) && widen(out[1]) > 0, dtype_name(d) << " inf + x = " << widen(out[1]));
    const double eps = d == DType::FLOAT16 ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);  // half an ulp
    int bad = 0;
    for (size_t i = 2; i < n; ++i) {
      const float got = widen(out[i]);
      if (size == 2) {
        const float sum32 = widen(value(0, i)) + widen(value(1, i));  // float32 reference, rounded once
        const uint16_t want = d == DType::FLOAT16 ? float_to_half(sum32) : float_to_bf16(sum32);
        if (out[i] != want && ++bad <= 3) {
          EXPECT(false, dtype_name(d) << " sum [" << i << "] = " << got << ", want " << widen(want));
        }
      } else {
        double exact = 0, magnitude = 0;
        for (int r = 0; r < size; ++r) {
          exact += widen(value(r, i));
          magnitude += std::fabs(widen(value(r, i)));
        }
        const double tolerance = 2 * eps * (size - 1) * magnitude + std::ldexp(1.0, -24) * size;
        if (std::fabs(got - exact) > tolerance && ++bad <= 3) {
          EXPECT(false, dtype_name(d) << " sum [" << i << "] = " << got << ", exact " << exact);
        }
      }
    }
    ++g_checks;
  }
}

}  // namespace

int main(int argc, char** argv) {
  mpi_test_init(&argc, &argv);
  run_or_abort([] { run_on_world_and_halves({test_16bit_random_sums}); });
  return mpi_test_finish("test_mpi_16bit");
}
