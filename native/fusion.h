// Stage 3: turn the negotiated, ordered list of ready requests into units.
//
// Small allreduce tensors that share dtype, reduction and scale factors are packed into one unit up to
// fusion_threshold_bytes; a tensor of at least inplace_threshold_bytes is reduced where it lies, split
// into units of at most fusion_threshold_bytes. Every other op is one unit per tensor. Every rank computes
// the same plan from the same negotiated list, so unit k is the same collective on every rank.
#pragma once

#include <vector>

#include "common.h"
#include "handles.h"

namespace perseus {

enum class UnitKind { PACKED, INPLACE, SINGLE };

struct Piece {
  Request* request;
  int64_t offset;      // first element of the request covered by this piece
  int64_t count;       // elements
  int64_t buf_offset;  // element offset in the unit's fusion buffer (PACKED)
};

struct Unit {
  UnitKind kind = UnitKind::SINGLE;
  OpType op_type = OpType::ALLREDUCE;
  DType dtype = DType::FLOAT32;
  ReduceOp reduce_op = ReduceOp::SUM;
  double prescale = 1.0, postscale = 1.0;
  int64_t numel = 0;
  int64_t index = 0;  // position in the process set's unit sequence; picks the channel
  Algorithm algorithm = Algorithm::AUTO;  // the set's setting when the unit was planned
  int32_t device = -1;  // >= 0: device memory; the launcher moves it (device_channel.h)
  std::vector<Piece> pieces;
  size_t nbytes() const { return static_cast<size_t>(numel) * itemsize(dtype); }
};

// A pool so that a step reuses the units (and their piece vectors) of the previous one. Thread-safe.
class UnitPool {
 public:
  ~UnitPool();
  Unit* get();
  void put(Unit* u);

 private:
  std::mutex mu_;
  std::vector<Unit*> free_;
  size_t most_pieces_ = 0;  // the most pieces a unit put back has held
};

// Split `requests` (in execution order) into units appended to `units`; sets each request's remaining
// count. `average_divisor` (the set's size) turns Average into Sum with a postscale.
// Device requests (Signature::device >= 0) use device_fusion_threshold_bytes for both thresholds: packing costs
// a device-to-device copy, far less than an extra collective, so every tensor below it is packed.
void plan_units(const std::vector<Request*>& requests, int64_t fusion_threshold_bytes,
                int64_t inplace_threshold_bytes, int average_divisor, UnitPool* pool, std::vector<Unit*>* units,
                int64_t device_fusion_threshold_bytes = 64 << 20);

}  // namespace perseus
