// Element-wise kernels the engine needs where MPI cannot help: scaling (prescale/postscale, Average),
// 16-bit float arithmetic (float16 and bfloat16 are combined in float32 and rounded once), and the
// reductions used by ring algorithms and user-defined MPI ops. Plain loops the compiler vectorises.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common.h"

namespace perseus {

// dst[i] = src[i] * factor for `count` elements (src may equal dst). Integers truncate toward zero, as
// Horovod does; bool is copied unchanged; float16/bfloat16 multiply in float32 and round once.
void scale_into(const void* src, void* dst, size_t count, DType dtype, double factor);

// out[i] = op(a[i], b[i]) (out may alias a or b). op is SUM, MIN, MAX or PRODUCT (AVERAGE is SUM).
// bool: SUM/MAX/AVERAGE are OR, MIN/PRODUCT are AND.
void combine(const void* a, const void* b, void* out, size_t count, DType dtype, ReduceOp op);

// out[i] = op(a[i], b[i]) * factor: combine() and scale_into() in one pass over the data where the dtype is
// a float and op a sum (float16/bfloat16 then round once, not twice); two passes otherwise.
void combine_scaled(const void* a, const void* b, void* out, size_t count, DType dtype, ReduceOp op,
                    double factor);

// Conversions (round to nearest even; NaN stays NaN).
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
inline float bf16_to_float(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}
uint16_t float_to_bf16(float f);

}  // namespace perseus
