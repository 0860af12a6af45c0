// The nouns every stage of the native core shares: element types, collective kinds, reductions,
// the per-name signature that ranks negotiate, clocks and errors.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace perseus {

// Same numbering as perseus.engine.messages.DType (Python passes these integers).
enum class DType : int32_t {
  UINT8 = 0, INT8 = 1, INT16 = 2, INT32 = 3, INT64 = 4, FLOAT16 = 5, BFLOAT16 = 6,
  FLOAT32 = 7, FLOAT64 = 8, BOOL = 9, UINT16 = 10,
};
constexpr int kNumDTypes = 11;

inline size_t itemsize(DType d) {
  static const size_t sizes[kNumDTypes] = {1, 1, 2, 4, 8, 2, 2, 4, 8, 1, 2};
  return sizes[static_cast<int>(d)];
}
const char* dtype_name(DType d);  // "float32", as numpy spells it ("bfloat16" for bfloat16)

// Same numbering as perseus.engine.messages.OpType.
enum class OpType : int32_t {
  ALLREDUCE = 0, ALLGATHER = 1, BROADCAST = 2, ALLTOALL = 3, REDUCESCATTER = 4, BARRIER = 5,
  // Change the set's run-time parameters at this point of the negotiated sequence (shape = the values;
  // see ProcessSet::apply_tune). No data moves.
  TUNE = 6,
};
const char* op_name(OpType op);  // "allreduce"

// How a large all-reduce unit runs (channels.cc); codes as in TUNE requests and PERSEUS_ALLREDUCE_ALGORITHM.
enum class Algorithm : int32_t { AUTO = 0, MPI = 1, RING = 2, HIERARCHICAL = 3 };

// Same numbering as perseus.base.reduce_ops.ReduceOp. AVERAGE travels as SUM plus a postscale.
enum class ReduceOp : int32_t { AVERAGE = 0, SUM = 1, ADASUM = 2, MIN = 3, MAX = 4, PRODUCT = 5 };
const char* reduce_op_title(ReduceOp op);  // "Sum", as Python's ReduceOp(x).name.title()

// What every rank must agree on for one tensor name. `shape` excludes the first dimension for
// allgather and alltoall, where it may differ between ranks.
struct Signature {
  OpType op_type = OpType::ALLREDUCE;
  DType dtype = DType::FLOAT32;
  std::vector<int64_t> shape;
  int32_t reduce_op = 1;
  int32_t root_rank = -1;
  double prescale = 1.0;
  double postscale = 1.0;
  int32_t priority = 0;
  int32_t device = -1;  // -1: host memory (the channels); >= 0: device memory, moved by the launcher

  bool operator==(const Signature& o) const {
    return op_type == o.op_type && dtype == o.dtype && shape == o.shape && reduce_op == o.reduce_op &&
           root_rank == o.root_rank && prescale == o.prescale && postscale == o.postscale &&
           priority == o.priority && device == o.device;
  }
  bool operator!=(const Signature& o) const { return !(*this == o); }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

// Error kinds carried to Python, which raises the matching exception type.
enum class ErrorKind : int32_t {
  NONE = 0, INTERNAL = 1, MISMATCH = 2, STALL = 3, NOT_IMPLEMENTED = 4, VALUE = 5,
};

struct Error {
  ErrorKind kind = ErrorKind::NONE;
  std::string message;
  explicit operator bool() const { return kind != ErrorKind::NONE; }
};

// A failure inside a collective; the channel reports it and the engine fails every rank.
class TransportError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

using Clock = std::chrono::steady_clock;  // CLOCK_MONOTONIC on Linux, as Python's time.monotonic
inline double now_s() {
  return std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
}
inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

// Python-style repr helpers for messages that must read exactly as the Python side's.
std::string py_repr(const std::string& s);          // 'name'
std::string py_repr(double v);                       // 1.0, 0.5, 1e+16
std::string py_repr(const std::vector<int64_t>& t);  // (2, 3) / (5,) / ()
std::string py_list(const std::vector<int>& v);      // [0, 2]

}  // namespace perseus
