// Helpers for the untyped buffers of requests, units and transports: element offsets and copies.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

namespace perseus {

// The address of element `elements` of a buffer of `dt`.
inline uint8_t* element_at(void* base, size_t elements, DType dt) {
  return static_cast<uint8_t*>(base) + elements * itemsize(dt);
}
inline const uint8_t* element_at(const void* base, size_t elements, DType dt) {
  return static_cast<const uint8_t*>(base) + elements * itemsize(dt);
}

// memcpy of n bytes; n == 0 is a no-op (memcpy may not be given a null pointer even then, and empty tensors
// and vectors may have none).
inline void copy_bytes(void* dst, const void* src, size_t n) {
  if (n != 0) std::memcpy(dst, src, n);
}

// Elements in one row of `shape` (every dimension but the first; 1 for a 0- or 1-dimensional shape).
inline int64_t row_elements(const std::vector<int64_t>& shape) {
  int64_t row = 1;
  for (size_t i = 1; i < shape.size(); ++i) row *= shape[i];
  return row;
}

}  // namespace perseus
